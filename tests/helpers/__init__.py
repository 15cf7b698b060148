"""Helpers the test modules share: job builders and harnesses (fakes of the ports are in tests/fakes.py,
fixtures in the conftest.py files). A test module imports from here, never from another test module
(tests/test_suite_shape.py checks it)."""
