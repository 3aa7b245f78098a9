"""pytest entry point of the conformance suite."""
