"""MovieLens (100,004 ratings, 671 users) from the Debian package r-cran-dslabs, read without R, as per-user tasks.

`ensure_ratings()` fetches the package once with `apt-get download` (no install, no root needed), unpacks only its R
data files, reads the `movielens` data frame with the PyPI package `rdata` and caches the columns this benchmark
uses as `~/.cache/optimum_pact/movielens/ratings.json` (or under `$PACT_CACHE`). `user_items()` turns one user's
ratings, in time order, into items: the text is "Title (year), genres", the label "liked" (rating >= 4) or "skip".
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

PACKAGE = "r-cran-dslabs"
DATA_DIR = "usr/lib/R/site-library/dslabs/data"  # inside the .deb
COLUMNS = ("userId", "title", "year", "genres", "rating", "timestamp")
LABELS = ("liked", "skip")  # one token each for SmolLM2's tokenizer
LIKED_AT = 4.0


def cache_dir(root: str | Path | None = None) -> Path:
    from optimum_pact.cache import cache_dir as pact_cache_dir

    return pact_cache_dir("movielens", root=root)


def _fetch_deb(folder: Path) -> Path:
    if shutil.which("apt-get") is None:
        raise RuntimeError(
            f"MovieLens comes from the Debian package {PACKAGE} and apt-get is not available here; on a Debian or "
            f"Ubuntu machine run `apt-get download {PACKAGE}` and pass the .deb with --movielens-deb."
        )
    result = subprocess.run(["apt-get", "download", PACKAGE], cwd=folder, capture_output=True, text=True)
    debs = sorted(folder.glob(f"{PACKAGE}_*.deb"))
    if result.returncode or not debs:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-3:])
        raise RuntimeError(
            f"`apt-get download {PACKAGE}` failed:\n{tail}\nRun `apt-get update` (as root) and retry, or download "
            f"the .deb elsewhere and pass it with --movielens-deb."
        )
    return debs[-1]


def _read_movielens(data_dir: Path):
    """The `movielens` data frame from an R lazy-load database (Rdata.rdx index + Rdata.rdb blobs)."""
    try:
        import rdata
    except ImportError:
        raise RuntimeError("reading MovieLens needs the PyPI package rdata: pip install optimum-pact[bench]") from None
    raw_index = gzip.decompress((data_dir / "Rdata.rdx").read_bytes())
    index = rdata.conversion.convert(rdata.parser.parse_data(raw_index, extension=".rds"))
    offset, length = (int(v) for v in index["variables"]["movielens"])
    with open(data_dir / "Rdata.rdb", "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    return rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(blob[4:]), extension=".rds"))


def ensure_ratings(root: str | Path | None = None, deb: str | Path | None = None) -> Path:
    """The cached ratings table (JSON of columns), fetched and converted once."""
    folder = cache_dir(root)
    out = folder / "ratings.json"
    if out.is_file():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    print(f"[movielens] fetching {PACKAGE} (4.6 MB, once)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        deb = Path(deb) if deb is not None else _fetch_deb(tmp)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp / "x")], check=True)
        frame = _read_movielens(tmp / "x" / DATA_DIR)
        table = {c: frame[c].astype(object).where(frame[c].notna(), None).tolist() for c in COLUMNS}  # NA -> null
        partial = tmp / "ratings.json"
        partial.write_text(json.dumps(table))
        partial.replace(out)  # whole or absent: a crash leaves no half-written cache
    return out


def load_ratings(path: Path) -> dict[int, list[dict]]:
    """Ratings per user, each list in time order (ties by title); the few ratings of untitled movies are dropped."""
    table = json.loads(Path(path).read_text())
    users: dict[int, list[dict]] = {}
    for row in zip(*(table[c] for c in COLUMNS)):
        record = dict(zip(COLUMNS, row))
        if record["title"] is None:
            continue
        users.setdefault(int(record["userId"]), []).append(record)
    for rows in users.values():
        rows.sort(key=lambda r: (r["timestamp"], r["title"]))
    return users


def item(record: dict) -> dict:
    year = f" ({record['year']})" if record["year"] is not None else ""
    genres = str(record["genres"] or "unknown").replace("|", ", ")
    label = LABELS[0] if record["rating"] >= LIKED_AT else LABELS[1]
    return {"text": f"{record['title']}{year}, {genres}", "label": label}


def most_active(users: dict[int, list[dict]], count: int) -> list[int]:
    """The `count` users with the most ratings (ties by id)."""
    return sorted(users, key=lambda u: (-len(users[u]), u))[:count]


def user_items(users: dict[int, list[dict]], user: int, limit: int) -> list[dict]:
    """The user's latest `limit` rated movies as items, oldest first."""
    if user not in users:
        raise ValueError(f"MovieLens has no user {user}; ids run from {min(users)} to {max(users)}")
    return [item(r) for r in users[user][-limit:]]
