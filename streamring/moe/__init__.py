"""MoE layer math shared by the batch and streamed paths (see :mod:`streamring.moe.math`)."""

from .math import *  # noqa: F401,F403
from .math import __all__  # noqa: F401
