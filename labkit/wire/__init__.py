"""The contract between the kernel and its ranks, used by both sides: signed framing with
tensors as out-of-band buffers (`codec`), the typed messages (`messages`), the rank's
configuration (`config`), comm/span records (`records`), the key file and the rank log file.

Imports only the standard library, torch (lazily), pyzmq's peers' needs and cryptography.
"""
