"""docs/design/QUEUE - the patches queued for a GPU run - against the tree: every queued patch
applies, in order, on a copy of the checkout; every variant applies on its base; every
docs/design/*.patch is listed (none forgotten, none missing); scripts/queue_patches.sh prints the
queue as PATCHES takes it. Needs git only (no GPU, no torch)."""

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design"


def queue():
    """(the queue in order, {variant: its base patches})."""
    order, variants = [], {}
    for line in (DESIGN / "QUEUE").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if "<-" in line:
            name, base = (part.strip() for part in line.split("<-", 1))
            variants[name] = [] if base == "main" else base.split()
        else:
            order.append(line)
    return order, variants


def tracked_copy(dest):
    """The checkout's tracked files as they are on disk, under dest."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        src = REPO / f.decode()
        if src.is_file():
            (dest / f.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f.decode())


def apply_in_order(tmp_path, names):
    tree = tmp_path / "tree"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir()
    tracked_copy(tree)
    for name in names:
        r = subprocess.run(["git", "apply", str(DESIGN / f"{name}.patch")], cwd=tree,
                           capture_output=True, text=True)
        assert r.returncode == 0, f"{name}.patch does not apply after {names}: {r.stderr}"


def test_every_patch_is_listed_once():
    order, variants = queue()
    listed = order + list(variants)
    assert len(listed) == len(set(listed)), "a patch listed twice"
    on_disk = sorted(p.stem for p in DESIGN.glob("*.patch"))
    assert sorted(listed) == on_disk, "docs/design/QUEUE and docs/design/*.patch differ"
    for name, base in variants.items():
        assert all(b in order or b in variants for b in base), f"{name}'s base is not queued"


def test_the_queue_applies_in_order(tmp_path):
    order, _ = queue()
    apply_in_order(tmp_path, order)


def test_each_variant_applies_on_its_base(tmp_path):
    _, variants = queue()
    for name, base in variants.items():
        apply_in_order(tmp_path, base + [name])


def test_queue_patches_prints_the_queue():
    order, _ = queue()
    out = subprocess.run(["bash", str(REPO / "scripts" / "queue_patches.sh")], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == ",".join(f"docs/design/{name}.patch" for name in order)
