"""The vocabulary of torch functions that :mod:`parity.record.functional` and :mod:`parity.record.routing`
read: ops that only rearrange a tensor, ops that look rows up in a table, ops that multiply by a matrix."""

from __future__ import annotations

#: ops that give a tensor's own values in another layout or dtype: a projection reading the result reads
#: the parameter it came from (TransformerLens rearranges ``W_Q`` to ``(heads * d_head, d_model)`` for F.linear)
REARRANGES = frozenset(
    {
        "permute", "reshape", "view", "view_as", "reshape_as", "transpose", "t", "T", "mT", "flatten", "unflatten",
        "contiguous", "movedim", "swapaxes", "swapdims", "squeeze", "unsqueeze", "to", "float", "double", "half",
        "bfloat16", "type_as", "clone", "detach",
    }
)  # fmt: skip
#: ops that read a table by index (an embedding lookup) and ops that multiply by a matrix (a projection)
LOOKUPS = frozenset({"embedding", "__getitem__", "index_select", "take", "take_along_dim"})
PRODUCT_NAMES = frozenset(
    {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "einsum", "addmm", "baddbmm", "tensordot"}
)
#: ops that apply a norm's weight vector: a norm computed in functions (``F.rms_norm(x, shape, w)``, or
#: ``F.rms_norm(x, shape) * w``) where the module holding ``w`` never runs its own forward
NORM_WEIGHT_NAMES = frozenset({"rms_norm", "layer_norm", "mul", "__mul__", "__rmul__"})
#: ops computing a norm's statistic from its input (a mean square, a mean, a variance): the first of them
#: after a norm's weight was applied reads the next norm's input
STATISTIC_NAMES = frozenset(
    {"pow", "square", "mean", "var", "var_mean", "std", "rms_norm", "layer_norm", "norm", "vector_norm"}
)
#: element-wise ops that make a weight of another from a parameter and constants alone (a norm's ``1 + w``
#: computed in the forward, ``w * scale``, ``-w``): their result is still that parameter, in another form
DERIVES = frozenset(
    {
        "add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "mul", "__mul__", "__rmul__", "div",
        "__truediv__", "__rtruediv__", "neg", "__neg__",
    }
)  # fmt: skip
LOOKUP, PRODUCT = "lookup", "product"


def op_name(func) -> str:
    """The name of a torch function as ``__torch_function__`` sees it; a property's name (``T``) for its getter."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "")
    return name
