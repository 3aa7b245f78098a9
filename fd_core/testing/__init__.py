"""The conformance suite for platform plugins, shipped as a pytest plugin."""
