"""Shared helpers for the attn pytest suite. Torch-dependent tests skip themselves (with the
reason) when torch is not installed; the rest needs only NumPy."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
sys.path.insert(0, FIXTURES)  # st_format.py (pure-Python safetensors), gen_demo.py (the chapter)
