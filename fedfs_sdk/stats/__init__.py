"""Device-side statistics and their federation-wide sum (issue 29): :mod:`.contributions` (what a
device computes and clips, the one sum), :mod:`.impostor_model` (in-domain impostor scores from the
summed feature moments), :mod:`.tail` (the federation's tail shape along public directions),
:mod:`.privacy` (optional Gaussian DP noise on the sums, and the mechanism a published sum records)."""
from .contributions import *  # noqa: F401,F403
from .contributions import __all__ as _c
from .impostor_model import *  # noqa: F401,F403
from .impostor_model import __all__ as _i
from .tail import *  # noqa: F401,F403
from .tail import __all__ as _t

__all__ = [*_c, *_i, *_t]
