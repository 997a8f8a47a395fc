"""`python -m mini_vllm`: the `mini-vllm` command line."""

from mini_vllm.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
