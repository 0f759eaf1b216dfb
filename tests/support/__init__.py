"""What several test folders share: snapshots for "a failed call changed nothing", the state
machines' harness, torch on demand, the test data's paths."""
