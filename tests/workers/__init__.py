"""The helper scripts the tests start in processes of their own (`python -m tests.workers.NAME`, or under
torchrun): each runs real jobs, roles or engines and writes what it saw for its test file to check."""
