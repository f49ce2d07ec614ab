"""The vocabulary both sides share, and the only part of `hpcjobs` the node side (`trainers/`) imports.

Everything here is torch-free and imports nothing outside the standard library and this package: the launch
contract, the run folder's layout, job and stop states, rendezvous ports, help flags, sweep points, the trainer's
flags, the torch floor and the timeouts a rank reads. The submit side names node-side modules only as text (the
command lines it renders), so neither side's imports reach into the other's (tests/test_imports.py checks it).
"""
