"""
What a Hub user runs, in a venv with stock torch and Transformers only (see `utils/stock_venv.py`): plain greedy, then the
lookahead strategy through a `custom_generate` repository or a model folder, and what each did.

    python stock_user.py '{"model": DIR, "routes": ["custom_generate", "model_folder"], "repo": DIR, ...}'

Prints one JSON line: `plain` (token lists per prompt), `calls` (per route, per call settings, per prompt: tokens and
forward passes, as the lookahead output counts them, else as a forward hook does, or the `ValueError` a route raised
for the setting), and whether this interpreter could
import `transformers_lookahead` at all. One process runs every route: the venv's imports and plain greedy once.
"""

import importlib.util
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def main(job: dict) -> dict:
    plain_model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    common = {"max_new_tokens": job["max_new_tokens"], "do_sample": False}
    prompts = [torch.tensor([prompt]) for prompt in job["prompts"]]
    plain = [plain_model.generate(prompt, **common)[0].tolist() for prompt in prompts]
    calls, loaded, passes = {}, {}, []
    for route_name in job["routes"]:
        before = set(sys.modules)
        if route_name == "model_folder":
            model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32, trust_remote_code=True)
            route = {}
        else:
            model, route = plain_model, {"custom_generate": job["repo"], "trust_remote_code": True}
        hook = model.register_forward_hook(lambda *_: passes.append(1))
        calls[route_name] = []
        for settings in job["calls"]:
            results = []
            for prompt in prompts:
                passes.clear()
                try:
                    out = model.generate(prompt, **common, **route, **settings, return_dict_in_generate=True)
                except ValueError as error:  # a setting the route refuses
                    results.append({"error": str(error)})
                    continue
                # The lookahead loop counts its own passes (the first "auto" call also times ~84 passes to price steps).
                counted = getattr(out, "num_forward_passes", None)
                results.append(
                    {"tokens": out.sequences[0].tolist(), "passes": len(passes) if counted is None else counted}
                )
            calls[route_name].append(results)
        hook.remove()
        # The modules of the `custom_generate/` folder this route ran.
        loaded[route_name] = sorted(
            {name.split(".")[-1] for name in set(sys.modules) - before if ".custom_generate." in name}
        )
    return {
        "plain": plain,
        "calls": calls,
        "lookahead_importable": importlib.util.find_spec("transformers_lookahead") is not None,
        "loaded": loaded,
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
