"""The conformance suites: subclass PlatformSuite in a platform plugin's tests, ModelSuite in a model package's,
TransportSuite in a KV transport's."""

from fd_core.capabilities import Capabilities, capabilities_of
from fd_core.testing.kernels import KernelTests
from fd_core.testing.model_suite import ModelSuite
from fd_core.testing.suite import (
    AllReduceTests,
    CleanupTests,
    ContractTests,
    EligibilityTests,
    GraphBackendTests,
    ModelTests,
    PlatformSuite,
)
from fd_core.testing.transports import TransportSuite

__all__ = [
    "AllReduceTests",
    "Capabilities",
    "CleanupTests",
    "ContractTests",
    "EligibilityTests",
    "GraphBackendTests",
    "KernelTests",
    "ModelSuite",
    "ModelTests",
    "PlatformSuite",
    "TransportSuite",
    "capabilities_of",
]
