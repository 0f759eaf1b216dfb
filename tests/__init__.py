"""The test suite. Its folders mirror atb_mem's subpackages (memory, kv, scheduling,
observability, tools); ``package`` tests the package as a whole (its public names, errors,
stubs, the README); ``support`` holds what several folders share; ``data`` the test data."""
