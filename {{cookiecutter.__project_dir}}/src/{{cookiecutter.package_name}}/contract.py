"""What the owner's files (``tasks/``, ``models/``, ``data/``, ``callbacks/``) use of the
engine, and all they use of it: a callback subclasses ``Callback``; a task subclasses
``TaskDefaults`` (the interface is ``Task``; its ``training_step`` takes the ``Step``'s
verbs), averages its evaluation with
``average_over_batches`` and groups the parameters with ``decay_groups``; a model or
data function checks its arguments with ``require`` (a bad value is a ``ConfigError``:
exit 2 before any work); a data function returns ``make_loaders(...)``, and text data
tokenizes with ``load_tokenizer``; chat data renders conversations with the engine's
chat templates (``chat_template``, ``chat_tokenizer``, ``check_messages``,
``encode_chat``: ids and the assistant's tokens); text files are read, or refused
naming the file, by ``read_file``, ``json_rows`` and ``find_files``; sequences are
packed per document by ``pack`` and ``PackedRows``; data that caches what it builds
holds ``locked`` meanwhile, so one process of a launch builds and the others read
(docs/own-model.md, docs/data.md, docs/finetune.md).
"""

from training_engine.batch_means import average_over_batches
from training_engine.callbacks import Callback
from training_engine.chat import chat_template, chat_tokenizer, check_messages
from training_engine.chat import encode as encode_chat
from training_engine.config import ConfigError, require
from training_engine.files import locked
from training_engine.loaders import LOADER_KEYS, DataLoaders, make_loaders
from training_engine.packing import IGNORE, PackedRows, pack, pieces
from training_engine.param_groups import decay_groups
from training_engine.step import Step
from training_engine.task import Task, TaskDefaults
from training_engine.text_files import find_files, json_rows, read_file
from training_engine.token_file import token_file, write_tokens
from training_engine.tokenizer import load_tokenizer

__all__ = [
    "IGNORE",
    "LOADER_KEYS",
    "Callback",
    "ConfigError",
    "DataLoaders",
    "PackedRows",
    "Step",
    "Task",
    "TaskDefaults",
    "average_over_batches",
    "chat_template",
    "chat_tokenizer",
    "check_messages",
    "decay_groups",
    "encode_chat",
    "find_files",
    "json_rows",
    "load_tokenizer",
    "locked",
    "make_loaders",
    "pack",
    "pieces",
    "read_file",
    "require",
    "token_file",
    "write_tokens",
]
