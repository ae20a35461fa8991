"""The fault-injecting S3 proxy for the fault tests: the one in the package (the soak uses it
too). Kept as an import path so the tests read ``from tests.faults import FaultProxy``."""

from hardelete.faultproxy import FaultProxy, Faults

__all__ = ["FaultProxy", "Faults"]
