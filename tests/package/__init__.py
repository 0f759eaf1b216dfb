"""Tests of the package as a whole: its public names, errors, stubs and README."""
