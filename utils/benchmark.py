"""`make bench`: greedy vs prompt lookup vs lookahead decoding on SmolLM2-135M-Instruct. See --help."""

from transformers_lookahead.benchmark import main

if __name__ == "__main__":
    main()
