"""Moved: the command line's argument types and pre-flight checks live in :mod:`memlm.cli.validate`.

This alias keeps ``import memlm.validate`` working for one release, with a DeprecationWarning.
"""

import warnings

from memlm.cli.validate import *  # noqa: F403
from memlm.cli.validate import __doc__ as _moved_doc  # noqa: F401

warnings.warn(
    "memlm.validate moved to memlm.cli.validate (argparse types belong to the CLI); the old path goes in the next "
    "release",
    DeprecationWarning,
    stacklevel=2,
)
