"""Near-duplicate documents by MinHash over word shingles, found with locality-sensitive
hashing (Broder 1997; Leskovec, Rajaraman and Ullman, "Mining of Massive Datasets", ch. 3).

A document's shingles are its runs of SHINGLE consecutive words (``\\w+``, bytes); each word
is hashed by CRC-32 and a shingle by a multiply-and-mix of its words' hashes, all in uint64,
so the signature is the same in every process and on every machine (Python's ``hash`` is
salted per process). The signature is PERMS minima of the shingle hashes under PERMS
bijections of uint64 (x -> mix((x xor s_i) * a_i), a_i odd): two documents agree in one
slot with probability their Jaccard similarity J, so the fraction of agreeing slots
estimates J (standard error sqrt(J (1 - J) / PERMS), 0.035 at J = 0.8).

Candidates: the signature in BANDS bands of PERMS / BANDS slots; documents with one band
equal are candidates (a pair at J is found with probability 1 - (1 - J^rows)^BANDS: 0.9999
at J = 0.8 for 32 bands of 4). Each candidate is compared with the first document of its
band's bucket, and joined to it when the estimate is at least the threshold; the groups are
the connected components (union-find). In each group the first document in the caller's
order is kept.
"""
from __future__ import annotations

import re
import zlib

import numpy as np

SHINGLE = 5                 # words a shingle
PERMS = 128                 # signature slots
BANDS = 32                  # LSH bands of PERMS / BANDS slots
_WORD = re.compile(rb"\w+")
_MIX = np.uint64(0xBF58476D1CE4E5B9)
_CHUNK = 1 << 15            # shingles hashed at once (PERMS x 8 bytes each)


def _params(seed: int = 0x5EED) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 2**63, size=PERMS, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    s = rng.integers(0, 2**63, size=PERMS, dtype=np.uint64)
    return a, s


_A, _S = _params()


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every output bit depends on every input bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX
    return x ^ (x >> np.uint64(31))


def shingles(data: bytes) -> np.ndarray:
    """The distinct shingle hashes of a document (uint64); a document of fewer than SHINGLE
    words is one shingle of all its words, an empty one has none."""
    words = _WORD.findall(data)
    if not words:
        return np.zeros(0, np.uint64)
    w = np.fromiter(map(zlib.crc32, words), dtype=np.uint64, count=len(words))
    n = max(1, len(w) - SHINGLE + 1)
    h = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(min(SHINGLE, len(w))):
            h = _mix(h * np.uint64(0x100000001B3) + w[j:j + n] + np.uint64(j + 1))
    return np.unique(h)


def signature(data: bytes) -> np.ndarray:
    """The MinHash signature (PERMS uint64) of a document; all-ones when it has no words
    (such documents are near-duplicates only of each other)."""
    sh = shingles(data)
    out = np.full(PERMS, np.iinfo(np.uint64).max, np.uint64)
    with np.errstate(over="ignore"):
        for i in range(0, len(sh), _CHUNK):
            block = sh[i:i + _CHUNK, None]
            out = np.minimum(out, _mix((block ^ _S) * _A).min(axis=0))
    return out


def similarity(a: np.ndarray, b: np.ndarray) -> float:
    """The Jaccard similarity two signatures estimate."""
    return float(np.mean(a == b))


def groups(signatures: np.ndarray, threshold: float) -> list[int]:
    """For each document (a row of signatures, in the caller's order), the index of the
    document its near-duplicate group keeps: its own index when it is kept."""
    if not 0 < threshold <= 1:
        raise ValueError(f"the near-duplicate threshold must be in (0, 1], got {threshold}")
    n = len(signatures)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    rows = PERMS // BANDS
    for b in range(BANDS):
        band = np.ascontiguousarray(signatures[:, b * rows:(b + 1) * rows])
        keys = band.view(np.dtype((np.void, band.dtype.itemsize * rows))).ravel()
        first: dict[bytes, int] = {}
        for i, key in enumerate(keys.tolist()):
            j = first.setdefault(key, i)
            if j != i and find(i) != find(j) and \
                    similarity(signatures[i], signatures[j]) >= threshold:
                ri, rj = find(i), find(j)
                parent[max(ri, rj)] = min(ri, rj)       # the earlier document stays root
    return [find(i) for i in range(n)]
