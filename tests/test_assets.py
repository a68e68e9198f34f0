import struct
import tempfile
import unittest
import wave
from pathlib import Path

import numpy as np
import torch

from utils.assets import SAMPLING_RATE, read_ctranslate2, read_wav


def _string(text: str) -> bytes:
    data = text.encode() + b"\x00"
    return struct.pack("<H", len(data)) + data


class AssetReadersTest(unittest.TestCase):
    def test_read_wav_resamples_and_mixes_down(self):
        rate, seconds = 22050, 0.5
        times = np.arange(int(rate * seconds)) / rate
        tone = 0.5 * np.sin(2 * np.pi * 440 * times)
        stereo = np.stack([tone, tone], axis=1)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "tone.wav"
            with wave.open(str(path), "wb") as file:
                file.setnchannels(2)
                file.setsampwidth(2)
                file.setframerate(rate)
                file.writeframes((stereo * 32767).astype(np.int16).tobytes())
            samples = read_wav(path)
        self.assertEqual(samples.dtype, np.float32)
        self.assertAlmostEqual(len(samples) / SAMPLING_RATE, seconds, places=3)
        expected = 0.5 * np.sin(2 * np.pi * 440 * np.arange(len(samples)) / SAMPLING_RATE)
        np.testing.assert_allclose(samples, expected, atol=0.02)

    def test_read_ctranslate2(self):
        weight = np.arange(6, dtype=np.float16).reshape(2, 3)
        heads = np.array(6, dtype=np.int16)
        body = struct.pack("<I", 6) + _string("WhisperSpec") + struct.pack("<I", 3) + struct.pack("<I", 2)
        body += _string("decoder/weight") + struct.pack("<B", 2) + struct.pack("<II", 2, 3)
        body += struct.pack("<B", 4) + struct.pack("<I", weight.nbytes) + weight.tobytes()
        body += _string("decoder/num_heads") + struct.pack("<B", 0)
        body += struct.pack("<B", 2) + struct.pack("<I", heads.nbytes) + heads.tobytes()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model.bin"
            path.write_bytes(body + struct.pack("<I", 0))
            variables = read_ctranslate2(path)
            self.assertTrue(torch.equal(variables["decoder/weight"], torch.from_numpy(weight)))
            self.assertEqual(int(variables["decoder/num_heads"]), 6)
            path.write_bytes(struct.pack("<I", 5) + body[4:])
            with self.assertRaisesRegex(ValueError, "format 5, expected 6"):
                read_ctranslate2(path)
