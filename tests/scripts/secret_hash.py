"""Prints the sha256 of the variable HPCJOBS_TEST_SECRET_NAME names (tests/test_secrets.py): a rank proves it got a
secret's value without the value ever reaching its log."""

import hashlib
import os

name = os.environ.get("HPCJOBS_TEST_SECRET_NAME", "HPCJOBS_CANARY_TOKEN")
value = os.environ.get(name)
digest = hashlib.sha256(value.encode()).hexdigest() if value is not None else "missing"
print(f"rank {os.environ.get('RANK')} {name} sha256 {digest}", flush=True)
