"""What a test that needs torch says when it is missing: torch is an extra (`corral[torch]`), not
part of `dev`, so that the demo and most of the suite never download it."""

TORCH_MISSING = (
    "torch is not installed: pip install -c constraints.txt 'torch' (the CPU build: add "
    "--index-url https://download.pytorch.org/whl/cpu), or make venv EXTRAS=dev,torch"
)
