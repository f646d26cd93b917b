"""data=text reads what corpora come as: plain, gzip, bzip2, xz and zstd files, JSON
lines, JSON arrays and parquet, each to the same documents and tokens; it refuses,
naming the file, what is not text (a binary, another encoding, compressed bytes under
a plain name, a broken JSON line, a missing column, nothing at all); and the
tokenizer recipe of docs/text.md gives back characters it never saw."""

import bz2
import gzip
import json
import logging
import lzma
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
from training_engine.config import ConfigError

from {{ cookiecutter.package_name }}.contract import read_file
from {{ cookiecutter.package_name }}.data.text import check_round_trip, text

DOCS = ["first document: naïve café 日本\nwith two lines", "second one", "third, the last"]


def write_formats(root: Path) -> dict[str, Path]:
    """The three documents in every format: name -> the file (or folder of files)."""
    root.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS))
    written = {
        "jsonl": ("docs.jsonl", lines.encode()),
        "jsonl.gz": ("docs.jsonl.gz", gzip.compress(lines.encode())),
        "jsonl.bz2": ("docs.jsonl.bz2", bz2.compress(lines.encode())),
        "jsonl.xz": ("docs.jsonl.xz", lzma.compress(lines.encode())),
        "json array": ("docs.json", json.dumps([{"text": d} for d in DOCS]).encode()),
    }
    if find_spec("zstandard"):
        import zstandard

        written["jsonl.zst"] = (
            "docs.jsonl.zst",
            zstandard.ZstdCompressor().compress(lines.encode()),
        )
    paths = {}
    for name, (file, data) in written.items():
        (root / file).write_bytes(data)
        paths[name] = root / file
    if find_spec("pyarrow"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": DOCS}), root / "docs.parquet")
        paths["parquet"] = root / "docs.parquet"
    for i, d in enumerate(DOCS):  # plain and gzip'd text: one file per document
        folder = root / "plain"
        folder.mkdir(exist_ok=True)
        (folder / f"{i}.txt").write_text(d, encoding="utf-8")
        gz = root / "gz"
        gz.mkdir(exist_ok=True)
        (gz / f"{i}.txt.gz").write_bytes(gzip.compress(d.encode()))
    return paths


def test_every_format_reads_to_the_same_documents_and_tokens(tmp_path):
    paths = write_formats(tmp_path / "corpus")
    assert len(paths) >= 5  # jsonl plain and 3 stdlib compressions, a JSON array
    for name, path in paths.items():
        documents, report = read_file(path, "file", "text")
        assert documents == DOCS, name
        assert report["documents"] == 3 and report["invalid_bytes"] == 0, name
    for folder in ("plain", "gz"):
        files = sorted((tmp_path / "corpus" / folder).iterdir())
        assert [read_file(f, "file", "text")[0][0] for f in files] == DOCS, folder

    def tokens(files: str) -> np.ndarray:
        cache = tmp_path / "cache"
        text(files=files, batch_size=2, seed=0, vocab_size=257, seq_len=4, cache_dir=str(cache))
        (folder,) = [p for p in cache.iterdir() if p.is_dir() and (p / "source.json").exists()]
        train = np.fromfile(folder / "train.bin", dtype=np.uint16)
        report = json.loads((folder / "source.json").read_text())
        for p in cache.iterdir():  # the next call tokenizes again
            if p.is_dir():
                for f in p.iterdir():
                    f.unlink()
                p.rmdir()
        return train, report

    plain, _ = tokens(str(tmp_path / "corpus" / "plain" / "*.txt"))
    gzipped, report = tokens(str(tmp_path / "corpus" / "gz" / "*.txt.gz"))
    assert np.array_equal(plain, gzipped)
    assert [f["compression"] for f in report["files"]] == ["gzip"] * 3
    assert {f["format"] for f in report["files"]} == {"text"}
    _, lines = tokens(str(paths["jsonl.gz"]))
    assert lines["files"][0] | {"path": None} == {
        "path": None,
        "compression": "gzip",
        "bytes": len(
            b"".join(json.dumps({"text": d, "id": i}).encode() + b"\n" for i, d in enumerate(DOCS))
        ),
        "format": "json",
        "rows": 3,
        "rows_without_column": 0,
        "invalid_bytes": 0,
        "documents": 3,
        "characters": sum(map(len, DOCS)),
    }


def refused(path: Path, column: str = "text") -> str:
    with pytest.raises(ConfigError) as err:
        read_file(path, "file", column)
    message = str(err.value)
    assert str(path) in message
    return message


def test_what_is_not_text_is_refused_naming_the_file_and_why(tmp_path):
    binary = tmp_path / "ls.txt"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4)
    assert "holds NUL bytes" in refused(binary)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café crème brûlée à la carte ".encode("latin-1") * 20)
    assert "are not valid UTF-8" in refused(latin1)
    one_stray = tmp_path / "stray.txt"  # one bad byte in 2,000: read, as U+FFFD
    one_stray.write_bytes(b"a" * 1999 + b"\xff")
    documents, report = read_file(one_stray, "file", "text")
    assert documents == ["a" * 1999 + "\ufffd"] and report["invalid_bytes"] == 1
    hidden = tmp_path / "man.1"
    hidden.write_bytes(gzip.compress(b"a man page"))
    assert "gzip-compressed, but its name does not say so: name it man.1.gz" in refused(hidden)
    broken = tmp_path / "broken.txt.gz"
    broken.write_bytes(gzip.compress(b"some text")[:-6])
    assert "does not decompress as gzip" in refused(broken)
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text('{"text": "fine"}\n{"text": oops}\n')
    assert "line 2 is not JSON" in refused(bad_line)
    other_column = tmp_path / "other.jsonl"
    other_column.write_text('{"body": "a"}\n{"body": "b"}\n')
    assert "no row has the column 'text' (data.column); its keys: ['body']" in refused(other_column)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    with pytest.raises(ConfigError, match="files holding some text"):
        text(
            files=str(empty / "*.txt"),
            batch_size=2,
            seed=0,
            vocab_size=257,
            cache_dir=str(tmp_path / "c"),
        )


def test_the_docs_tokenizer_recipe_round_trips_characters_it_never_saw(tmp_path, caplog):
    pytest.importorskip("tokenizers", reason="the hf extra")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from training_engine.tokenizer import load_tokenizer

    corpus = tmp_path / "ascii.txt"
    corpus.write_text("plain ascii text, the only characters it sees. " * 200)

    def trained(**alphabet) -> Path:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], **alphabet)
        tok.train([str(corpus)], trainer)
        path = tmp_path / f"tok{len(alphabet)}.json"
        tok.save(str(path))
        return path

    unseen = ["naïve café 日本 🙂", "ascii too"]
    recipe = load_tokenizer(str(trained(initial_alphabet=pre_tokenizers.ByteLevel.alphabet())))
    assert [recipe.decode(i) for i in recipe.encode_batch(unseen)] == unseen
    with caplog.at_level(logging.WARNING):
        assert check_round_trip(recipe, unseen) == 0 and not caplog.text
        lossy = load_tokenizer(str(trained()))  # without the byte alphabet
        assert check_round_trip(lossy, unseen) == 0.5
    assert "50% of 2 documents sampled do not come back unchanged" in caplog.text
