"""The conformance suite for platform plugins: subclass PlatformSuite in your plugin's tests."""

from fd_core.capabilities import Capabilities, capabilities_of
from fd_core.testing.kernels import KernelTests
from fd_core.testing.suite import (
    AllReduceTests,
    CleanupTests,
    ContractTests,
    EligibilityTests,
    GraphBackendTests,
    ModelTests,
    PlatformSuite,
)

__all__ = [
    "AllReduceTests",
    "Capabilities",
    "CleanupTests",
    "ContractTests",
    "EligibilityTests",
    "GraphBackendTests",
    "KernelTests",
    "ModelTests",
    "PlatformSuite",
    "capabilities_of",
]
