"""
`transformers serve` with the guide's upstream proposal applied, to test the proposal: where `from_pretrained` binds
a folder's `custom_generate/generate.py` `generate` to the model, it also binds the same file's
`init_continuous_batching`, which `transformers serve --continuous-batching` (and `generate_batch`) calls. Stock
Transformers binds `generate` only; nothing here is needed to use the package.

    python utils/proposed_serving_hook.py serve FOLDER --trust-remote-code --continuous-batching

takes the arguments of the `transformers` command. The patch is applied when this file is imported, so Transformers
5.25, which loads the model in a process it spawns (importing this file there as `__mp_main__`), applies it there too.
"""

import functools
import sys

from transformers.generation.utils import GenerationMixin

_stock_load_custom_generate = GenerationMixin.load_custom_generate


def _load_custom_generate(self, *args, **kwargs):
    """The stock loader, then the proposal's three lines (see the guide's Serving section)."""
    custom_generate = _stock_load_custom_generate(self, *args, **kwargs)
    custom_init = getattr(sys.modules[custom_generate.__module__], "init_continuous_batching", None)
    if custom_init is not None:
        self.init_continuous_batching = functools.partial(custom_init, model=self)
    return custom_generate


GenerationMixin.load_custom_generate = _load_custom_generate

if __name__ == "__main__":
    from transformers.cli.transformers import main

    sys.exit(main())
