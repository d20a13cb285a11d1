"""A corpus of fresh documents from Debian packages: issue 33's steady state measured on text never repeated.

    python -m bench.fresh_corpus [--mb 400]

The shared corpora hold about 17 MB of unique text, so bench/peers.py's corpus repeats and varies the multilingual
one, which an encoder's cache of words finds friendlier than fresh text. This corpus repeats nothing: every
document is one file (one HTML page, one manual page, one source file) of a Debian package, taken once.

The mix, in the order it fills --mb (prose first, then source code for the rest):
  prose  HTML manuals in many languages (one document a page, the text as python's html.parser reads it; whole-
         book single pages, search and index pages left out, their text being the pages'): the installation
         guide (19 languages), the Debian Administrator's Handbook (26), the Securing Debian manual (8), the New
         Maintainers' Guide (11), the Developer's Reference (6), the FAQ (10), the Policy manual (2), LibreOffice's
         help (33); manual pages in 25 languages, rendered to plain text by man-db (`man -l`, groff), a page man
         does not finish in 15 s left out. Not debian-reference-*: it is the text the benchmark's model was
         trained on (the shared corpus). About 198 MB, all of it in a 400 MB corpus.
  code   Linux 6.1's source (linux-source-6.1's tarball), one document a file, files taken in an order set by
         the hash of their path (so every part of the tree is sampled, not its first directories); files over
         1 MB left out, as The Stack leaves them out. About 202 MB of 400 (.c 130, .h 48, .rst 5, ...).
A document is dropped when it is not valid UTF-8, holds a NUL (a binary file), is empty, has the bytes of one
already taken, or is a near-duplicate: more than half of its bytes in paragraphs already taken (a LibreOffice page
no translator touched is the English one under a translated header, in each of 33 languages). Prose is taken in
the order of its texts' hashes (which copy of a near-duplicate stays is chance, not always the English one); the
corpus is in that order too, so languages, manuals and code are interleaved as in a shuffled pre-training shard.

The packages are fetched with `apt-get download` into bench/results/fresh/debs/ (kept; about 330 MB) and
extracted there one at a time with `dpkg-deb -x`; each package's documents are kept as a Parquet file under
bench/results/fresh/documents/, its extracted tree removed. The corpus is written once to
bench/results/peers/corpus-fresh-<mb>mb/corpus.parquet (bench.peers.write_parquet: one column, text; row groups of
1,000 documents; zstd), its mix beside it as mix.json.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path, PurePosixPath

from bench.inputs import RESULTS
from bench.peers import PEERS, write_parquet

FRESH = RESULTS / "fresh"
DEBS = FRESH / "debs"
DOCUMENTS = FRESH / "documents"
EXTRACTED = FRESH / "extracted"


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


MANPAGE_LANGUAGES = _words("cs da de el es fi fr hu id it ja mk nb nl pl pt-br ro ru sr sv tr uk vi zh")
LIBREOFFICE_LANGUAGES = _words(
    "ca cs da de dz el en-gb en-us es et eu fi fr gl hi hu id it ja km ko nl om pl pt pt-br ru sl sv tr vi zh-cn zh-tw"
)


@dataclass(frozen=True)
class Source:
    """A family of packages whose documents are pages: `kind` html or man; `language`: a pattern whose group 1,
    found in a page's path, is its language where the page does not say it (else the package's suffix, else en)."""

    family: str
    packages: tuple[str, ...]
    kind: str = "html"
    language: str = ""


def _translated(family: str, languages: str) -> tuple[str, ...]:
    return (family, *(f"{family}-{language}" for language in _words(languages)))


IN_NAME = r"\.([^./]+)\.html$"  # dreq.fr.html
PROSE = (
    Source("installation-guide-amd64", ("installation-guide-amd64",), language=r"installation-guide-amd64/([^/]+)/"),
    Source("debian-handbook", ("debian-handbook",), language=r"/html/([^/]+)/"),
    Source("harden-doc", ("harden-doc",), language=r"/html/([^/]+)/"),
    Source("maint-guide", _translated("maint-guide", "ca de es fr it ja ru vi zh-cn zh-tw"), language=IN_NAME),
    Source("developers-reference", _translated("developers-reference", "de fr it ja ru")),
    Source("debian-faq", _translated("debian-faq", "de fr it ja ko nl pt ru zh-cn"), language=IN_NAME),
    Source("debian-policy", ("debian-policy", "debian-policy-ja")),
    Source("manpages", tuple(f"manpages-{language}" for language in MANPAGE_LANGUAGES), "man", r"/man/([^/]+)/man"),
    Source("libreoffice-help", tuple(f"libreoffice-help-{language}" for language in LIBREOFFICE_LANGUAGES)),
)
CODE_PACKAGE = "linux-source-6.1"
CODE_TARBALL = "usr/src/linux-source-6.1.tar.xz"
LARGEST_SOURCE_FILE = 1_000_000
MAN_SECONDS = 15  # a page renders in 0.05 s
# pages whose text is other pages' text again: whole-book single pages (developers-reference.html, *-1.html of
# debian-policy), search and index pages, LibreOffice's no-JavaScript notice
REPEATING_PAGE = re.compile(r"(^|/)(developers-reference|search|genindex|noscript)\.html$|-1\.html$")


@dataclass(frozen=True)
class Document:
    text: str
    family: str
    label: str  # a language for prose, a file type for code
    size: int  # bytes of UTF-8
    digest: bytes


def document(text: str, family: str, label: str) -> Document:
    data = text.encode("utf-8")
    return Document(text, family, label, len(data), hashlib.blake2b(data, digest_size=16).digest())


# -- packages --------------------------------------------------------------------------------------------------


def deb_of(package: str) -> Path | None:
    found = sorted(DEBS.glob(f"{package}_*.deb"))
    return found[-1] if found else None


def download(packages: list[str]) -> dict[str, Path]:
    """The .deb of each package, fetched with apt-get where the cache lacks it (after `apt-get update` where apt
    cannot find one); a package the mirror does not have is left out, said so."""
    DEBS.mkdir(parents=True, exist_ok=True)
    missing = [package for package in packages if deb_of(package) is None]
    if missing and _apt_download(missing) != 0:
        subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True)
        for package in missing:
            if _apt_download([package]) != 0:
                print(f"{package}: not on this mirror, left out", flush=True)
    return {package: deb for package in packages if (deb := deb_of(package)) is not None}


def _apt_download(packages: list[str]) -> int:
    # as root apt cannot drop to its _apt user to write here; it says so and downloads anyway
    command = ["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", *packages]
    return subprocess.run(command, cwd=DEBS, capture_output=True).returncode


def extract(deb: Path) -> Path:
    tree = EXTRACTED / deb.stem
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tree)], check=True)
    return tree


# -- prose -----------------------------------------------------------------------------------------------------

BLOCKS = frozenset(
    _words(
        "address article aside blockquote caption dd div dl dt figcaption figure footer form h1 h2 h3 h4 h5 h6 "
        "header hr li main nav ol p pre section table td th tr ul"
    )
)
HIDDEN = frozenset(_words("head script style noscript template"))
SPACES = re.compile(r"\s+")


class PageText(HTMLParser):
    """The text a browser shows of a page: one paragraph a block element, whitespace collapsed outside <pre>,
    character references resolved (html.parser); `language`: the <html> element's lang, where it has one."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self.current: list[str] = []
        self.hidden = 0
        self.pre = 0
        self.language: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "html":
            self.language = dict(attrs).get("lang") or dict(attrs).get("xml:lang")
        elif tag == "body":
            self.hidden = 0  # a page that never closes its <head>
        elif tag == "br" and not self.hidden:
            self.current.append("\n")
        if tag in HIDDEN:
            self.hidden += 1
        elif tag in BLOCKS:
            self._close_block()
        if tag == "pre":
            self.pre += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in HIDDEN:
            self.hidden = max(0, self.hidden - 1)
        elif tag in BLOCKS:
            self._close_block()
        if tag == "pre":
            self.pre = max(0, self.pre - 1)

    def handle_data(self, data: str) -> None:
        if not self.hidden:
            self.current.append(data if self.pre else SPACES.sub(" ", data))

    def _close_block(self) -> None:
        text = "".join(self.current)
        self.current = []
        text = text.strip("\n").rstrip() if self.pre else "\n".join(line.strip() for line in text.split("\n"))
        if text.strip():
            self.blocks.append(text if self.pre else text.strip())

    def text(self) -> str:
        self._close_block()
        return "\n\n".join(self.blocks)


def html_document(path: Path) -> tuple[str, str | None] | None:
    """(text, language the page states) of an HTML page, None where it is not UTF-8 or shows no text."""
    try:
        markup = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None
    parser = PageText()
    parser.feed(markup)
    parser.close()
    text = parser.text()
    return (text, parser.language) if text.strip() else None


def man_document(path: Path) -> str | None:
    """A manual page as man-db renders it for a pipe (plain UTF-8 text, 80 columns, no hyphenation or
    justification); None for a page that only includes another (`.so`, an alias) or that man cannot render."""
    source = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    lines = [line for line in source.splitlines() if line.strip() and not line.startswith((b'.\\"', b"'\\\""))]
    if len(lines) <= 1 and (not lines or lines[0].startswith(b".so ")):
        return None
    env = {**os.environ, "LC_ALL": "C.UTF-8", "MANWIDTH": "80"}
    env.pop("MAN_KEEP_FORMATTING", None)
    command = ["man", "--nh", "--nj", "-E", "UTF-8", "-l", str(path)]
    with subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    ) as process:
        try:
            output, _ = process.communicate(timeout=MAN_SECONDS)
        except subprocess.TimeoutExpired:  # troff never ends some pages of long unbroken CJK lines
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            print(f"    {path.name}: man did not finish in {MAN_SECONDS} s, left out", flush=True)
            return None
    try:
        text = output.decode("utf-8").strip("\n")
    except UnicodeDecodeError:
        return None
    return text if process.returncode == 0 and text.strip() else None


def pages(tree: Path, kind: str) -> list[Path]:
    if kind == "man":
        root = tree / "usr" / "share" / "man"
        return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()) if root.exists() else []
    return sorted(
        p
        for p in tree.rglob("*.html")
        if p.is_file() and not p.is_symlink() and p.stat().st_size and not REPEATING_PAGE.search(p.as_posix())
    )


def package_documents(source: Source, package: str, deb: Path) -> list[Document]:
    """The documents of one package, read from its Parquet file under bench/results/fresh/documents/ or made
    from its extracted tree (then removed) once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cache = DOCUMENTS / f"{deb.stem}.parquet"
    if not cache.exists():
        tree = extract(deb)
        try:
            texts, languages = _render(source, package, tree)
        finally:
            shutil.rmtree(tree, ignore_errors=True)
        DOCUMENTS.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(".partial")
        pq.write_table(pa.table({"text": texts, "language": languages}), partial, compression="zstd")
        partial.rename(cache)
    table = pq.read_table(cache)
    return [
        document(text, source.family, language)
        for text, language in zip(table["text"].to_pylist(), table["language"].to_pylist(), strict=True)
    ]


def _render(source: Source, package: str, tree: Path) -> tuple[list[str], list[str]]:
    """(texts, languages) of a package's pages, in path order."""
    paths = pages(tree, source.kind)
    suffix = package[len(source.family) + 1 :] or "en"
    texts, languages = [], []
    with ThreadPoolExecutor(max_workers=2) as pool:  # man's renderings are processes: two at a time
        made = pool.map(man_document if source.kind == "man" else html_document, paths)
        for path, result in zip(paths, made, strict=True):
            if result is None:
                continue
            text, stated = (result, None) if isinstance(result, str) else result
            found = re.search(source.language, path.as_posix()) if source.language else None
            texts.append(text)
            languages.append(stated or (found.group(1) if found else suffix))
    return texts, languages


def prose_documents() -> Iterator[Document]:
    """Every prose document of every package, in PROSE's order, packages fetched first."""
    debs = download([package for source in PROSE for package in source.packages])
    for source in PROSE:
        for package in source.packages:
            if package in debs:
                print(f"  {package}", flush=True)
                yield from package_documents(source, package, debs[package])


# -- code ------------------------------------------------------------------------------------------------------


def code_documents(megabytes: float) -> tuple[list[Document], bool]:
    """Text files of the kernel's tarball, in the order of their path's hash, until their sizes (as the tarball
    lists them) reach `megabytes`, and whether that took them all: two passes over the tarball, one to list its
    files, one to read those chosen."""
    deb = download([CODE_PACKAGE]).get(CODE_PACKAGE)
    if deb is None:
        return [], True
    tree = extract(deb)
    try:
        tarball = tree / CODE_TARBALL
        listed = sorted(_listed(tarball), key=lambda item: _path_hash(item[0]))
        chosen, total = [], 0
        for name, size in listed:
            if total >= megabytes * 1e6:
                break
            chosen.append(name)
            total += size
        read = _read(tarball, set(chosen))
        return [read[name] for name in chosen if name in read], len(chosen) == len(listed)
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def _listed(tarball: Path) -> Iterator[tuple[str, int]]:
    with tarfile.open(tarball, mode="r|xz") as archive:
        for member in archive:
            if member.isfile() and 0 < member.size <= LARGEST_SOURCE_FILE:
                yield member.name, member.size


def _path_hash(name: str) -> bytes:
    return hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()


def _read(tarball: Path, names: set[str]) -> dict[str, Document]:
    """The named files that are text (UTF-8, no NUL, not blank), as documents labelled by their file type."""
    read = {}
    with tarfile.open(tarball, mode="r|xz") as archive:
        for member in archive:
            if member.name not in names:
                continue
            file = archive.extractfile(member)
            try:
                text = file.read().decode("utf-8") if file else ""
            except UnicodeDecodeError:
                continue
            if text.strip() and "\0" not in text:
                read[member.name] = document(text, CODE_PACKAGE, _file_type(member.name))
    return read


def _file_type(name: str) -> str:
    path = PurePosixPath(name)
    return path.suffix or path.name


# -- the corpus ------------------------------------------------------------------------------------------------


class Fresh:
    """What is taken so far: a document is fresh when its bytes are new and at most half of them are in
    paragraphs (blank-line separated) already taken; else it is a near-duplicate."""

    def __init__(self) -> None:
        self.documents: set[bytes] = set()
        self.paragraphs: set[bytes] = set()

    def copy(self) -> Fresh:
        twin = Fresh()
        twin.documents, twin.paragraphs = set(self.documents), set(self.paragraphs)
        return twin

    def take(self, found: Document) -> bool:
        if found.digest in self.documents:
            return False
        parts = [(_paragraph_hash(part), len(part.encode("utf-8"))) for part in found.text.split("\n\n")]
        if 2 * sum(size for key, size in parts if key in self.paragraphs) > found.size:
            return False
        self.documents.add(found.digest)
        self.paragraphs.update(key for key, _ in parts)
        return True

    def fill(self, candidates: list[Document], wanted: float, chosen: list[Document]) -> float:
        """Append fresh candidates to `chosen`, in order, while its size is under `wanted`; its new size."""
        size = sum(found.size for found in chosen)
        for found in candidates:
            if size >= wanted:
                break
            if self.take(found):
                chosen.append(found)
                size += found.size
        return size


def _paragraph_hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()


def select(megabytes: float) -> list[Document]:
    """Fresh documents whose UTF-8 reaches `megabytes`: prose first (in the order of its texts' hashes, which
    decides which of near-duplicates is kept, and what is left out where there is more than asked), then code;
    the whole in the order of the texts' hashes."""
    wanted = megabytes * 1e6
    fresh = Fresh()
    chosen: list[Document] = []
    size = fresh.fill(sorted(prose_documents(), key=lambda found: found.digest), wanted, chosen)
    prose = len(chosen)
    margin = 1.2  # for the files that are not text or not fresh
    while size < wanted:
        print(f"  {CODE_PACKAGE} ({(wanted - size) / 1e6:.1f} MB of it, {margin:.2f}x listed)", flush=True)
        candidates, whole = code_documents((wanted - size) / 1e6 * margin)
        trial, taken = fresh.copy(), list(chosen)
        if trial.fill(candidates, wanted, taken) >= wanted or whole:
            chosen = taken
            break
        margin *= 1.5
    print(f"  {prose:,} prose documents, {len(chosen) - prose:,} source files", flush=True)
    return sorted(chosen, key=lambda found: found.digest)


def fresh_documents(megabytes: float) -> list[str]:
    """The texts of `megabytes` of fresh, unique documents (see the module's docstring)."""
    return [found.text for found in select(megabytes)]


def mix_of(documents: list[Document]) -> dict[str, dict[str, object]]:
    """Per family: MB, documents, and MB per language (prose) or file type (code), largest first."""
    sizes: dict[str, Counter[str]] = defaultdict(Counter)
    counts: Counter[str] = Counter()
    for found in documents:
        sizes[found.family][found.label] += found.size
        counts[found.family] += 1
    return {
        family: {
            "mb": round(sum(labels.values()) / 1e6, 3),
            "documents": counts[family],
            "labels": {label: round(size / 1e6, 3) for label, size in labels.most_common()},
        }
        for family, labels in sizes.items()
    }


def describe(mix: dict[str, dict[str, object]]) -> str:
    lines = []
    total_mb = sum(float(entry["mb"]) for entry in mix.values())  # type: ignore[arg-type]
    total_documents = sum(int(entry["documents"]) for entry in mix.values())  # type: ignore[call-overload]
    for family, entry in sorted(mix.items(), key=lambda item: -float(item[1]["mb"])):  # type: ignore[arg-type]
        labels: dict[str, float] = entry["labels"]  # type: ignore[assignment]
        kind = "file types" if family == CODE_PACKAGE else "languages"
        shown = ", ".join(f"{label} {mb:.1f}" for label, mb in list(labels.items())[:12])
        more = f", +{len(labels) - 12} more" if len(labels) > 12 else ""
        lines.append(
            f"{family}: {entry['mb']:.1f} MB, {entry['documents']:,} documents; {len(labels)} {kind} (MB): "
            f"{shown}{more}"
        )
    lines.append(f"total: {total_mb:.1f} MB, {total_documents:,} documents")
    return "\n".join(lines)


def build_fresh_corpus(megabytes: float = 400) -> tuple[Path, list[str]]:
    """The fresh corpus's Parquet file (built once; its mix printed) and its texts."""
    import pyarrow.parquet as pq

    path = PEERS / f"corpus-fresh-{megabytes:g}mb" / "corpus.parquet"
    mix_file = path.with_name("mix.json")
    if path.exists() and mix_file.exists():
        texts = pq.read_table(path, columns=["text"])["text"].to_pylist()
        mix = json.loads(mix_file.read_text())
    else:
        print(f"building {path} from Debian packages (once) ...", flush=True)
        path.unlink(missing_ok=True)
        chosen = select(megabytes)
        texts = [found.text for found in chosen]
        write_parquet(path, texts)
        mix = mix_of(chosen)
        mix_file.write_text(json.dumps(mix, indent=1, ensure_ascii=False))
    print(describe(mix), flush=True)
    return path, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=400, help="the corpus's size in MB of UTF-8 text")
    args = parser.parse_args()
    path, texts = build_fresh_corpus(args.mb)
    size = sum(len(text.encode("utf-8")) for text in texts)
    print(f"{path}: {len(texts):,} documents, {size / 1e6:.1f} MB of text, {path.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
