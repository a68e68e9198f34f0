"""
`make hub-repo`: writes the lookahead decoding strategy as a Hub repository that stock Transformers runs.

    python utils/build_hub_repo.py DIR                          # README.md + custom_generate/ into DIR
    python utils/build_hub_repo.py DIR --repo-id owner/lookahead  # the id the README's example loads

`custom_generate/` is generated from the installed package (`transformers_lookahead.write_custom_generate`); the
README comes from `utils/hub_repo/README.md`. Upload DIR as it is (`hf upload owner/lookahead DIR`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

README_TEMPLATE = Path(__file__).resolve().parent / "hub_repo" / "README.md"


def build_hub_repo(directory: str | Path, repo_id: str | None = None) -> Path:
    """
    Writes the strategy repository into `directory` (created if missing): `README.md` and `custom_generate/`.

    Args:
        directory (`str` or `Path`): where to write.
        repo_id (`str`, *optional*): what the README's example passes as `custom_generate`; defaults to `directory`.

    Returns:
        `Path`: `directory`.
    """
    import transformers_lookahead

    folder = Path(directory)
    transformers_lookahead.write_custom_generate(folder)
    readme = README_TEMPLATE.read_text(encoding="utf-8")
    readme = readme.replace("{repo_id}", repo_id or str(folder)).replace(
        "{version}", transformers_lookahead.__version__
    )
    (folder / "README.md").write_text(readme, encoding="utf-8")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="where to write the repository")
    parser.add_argument("--repo-id", help="the repository id the README's example loads (default: DIRECTORY)")
    args = parser.parse_args()
    folder = build_hub_repo(args.directory, args.repo_id)
    print(
        f"Wrote the lookahead strategy repository to {folder}: " + ", ".join(sorted(p.name for p in folder.iterdir()))
    )


if __name__ == "__main__":
    main()
