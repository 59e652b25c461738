"""Imports every module that defines tables, so Base.metadata is complete."""
from . import models  # noqa: F401
