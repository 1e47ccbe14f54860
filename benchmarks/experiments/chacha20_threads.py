"""Does ``cryptography``'s ChaCha20 scale over threads? (secure-aggregation worker threads, session 3)

Expands 50 keystreams of 4 MB (the server's self masks at N = 50, D = 10^6) serially and on two
threads of 25 each, 7 times, and prints the medians. Run on an otherwise idle machine:
``python benchmarks/experiments/chacha20_threads.py``.
"""

from __future__ import annotations

import statistics
import threading
import time

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

KEY, NONCE, ZEROS = b"k" * 32, bytes(16), bytes(4_000_000)


def streams(n: int) -> None:
    for _ in range(n):
        Cipher(algorithms.ChaCha20(KEY, NONCE), None).encryptor().update(ZEROS)


def on_threads(parts: list[int]) -> float:
    threads = [threading.Thread(target=streams, args=(p,)) for p in parts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def main() -> None:
    serial, two = [], []
    for _ in range(7):
        t0 = time.perf_counter()
        streams(50)
        serial.append(time.perf_counter() - t0)
        two.append(on_threads([25, 25]))
    print(f"50 x 4 MB: serial {statistics.median(serial) * 1e3:.0f} ms, "
          f"2 threads {statistics.median(two) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
