"""attn: transformer attention with PyTorch's semantics and PyTorch's numbers.

The functional core ``scaled_dot_product_attention`` (torch.nn.functional's), the chapter's
modules (SelfAttentionV1 ... MultiHeadAttention), torch.nn's Linear, Dropout, Embedding and
MultiheadAttention, a generator that reproduces PyTorch's weights and dropout masks
(``manual_seed``), and safetensors files with PyTorch's state_dict names.

Inputs are NumPy arrays or DLPack tensors (PyTorch CPU tensors), read in place when they are
float32 with non-negative strides; outputs are NumPy arrays. Kernels run without the GIL.
"""
from ._attn import (  # noqa: F401
    CausalAttention,
    Dropout,
    Embedding,
    FormatError,
    Linear,
    Module,
    MultiheadAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttentionV1,
    SelfAttentionV2,
    load_file,
    load_metadata,
    manual_seed,
    rand,
    randn,
    save_file,
    scaled_dot_product_attention,
)

__version__ = "0.1.0"

__all__ = [
    "CausalAttention", "Dropout", "Embedding", "FormatError", "Linear", "Module",
    "MultiheadAttention", "MultiHeadAttention", "MultiHeadAttentionWrapper", "SelfAttentionV1",
    "SelfAttentionV2", "load_file", "load_metadata", "manual_seed", "rand", "randn", "save_file",
    "scaled_dot_product_attention",
]
