"""Generate videos with a QVG-compressed KV cache: ``python scripts/generate.py "a prompt"`` (see ``--help``).

Same as the ``qvg-generate`` console command; works under ``accelerate launch`` to split a prompts file.
"""

from diffusers_qvg.cli import main

if __name__ == "__main__":
    main()
