"""Columnar inputs: Parquet files and Arrow IPC files (a Hugging Face `save_to_disk` folder's shards), read
through pyarrow by record batches, one column of strings (`text`, or the one `--text-field` names).

Memory is bounded by a record batch, whatever the file's size: Parquet is read `PARQUET_BATCH_ROWS` rows at a
time, an Arrow file through a memory map (its batches are views, not copies). A skipped batch is counted from
its null count, never turned into Python strings; a skipped Parquet row group is not even read.
"""

from __future__ import annotations

from collections.abc import Iterator

from large_model_training.errors import ConfigError

PARQUET_BATCH_ROWS = 1024  # rows per record batch: bounds memory by batch, whatever the file's size
ARROW_FILE_MAGIC = b"ARROW1"  # the random-access IPC format starts with it; datasets writes the stream format


def one_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _pyarrow(path: str):
    try:
        import pyarrow as pa
    except ImportError:
        raise ConfigError(f"reading {path} needs the pyarrow package: pip install pyarrow") from None
    return pa


def _check_text_column(path: str, kind: str, schema, field: str) -> None:
    """The column must exist and hold strings; a one-line error naming the columns there are otherwise."""
    pa = _pyarrow(path)
    if schema.get_field_index(field) < 0:
        raise ConfigError(f"{kind} {path} has no column '{field}' (columns: {', '.join(schema.names)})")
    text_type = schema.field(field).type
    if pa.types.is_dictionary(text_type):
        text_type = text_type.value_type
    if not (
        pa.types.is_string(text_type)
        or pa.types.is_large_string(text_type)
        or getattr(pa.types, "is_string_view", lambda _: False)(text_type)
    ):
        raise ConfigError(f"{kind} {path}: column '{field}' is {text_type}, expected strings")


def _column_documents(columns: Iterator, skip: int) -> Iterator[tuple[int, str | None]]:
    """(documents skipped, document or None) for each non-null string of a stream of Arrow arrays."""
    for values in columns:
        present = len(values) - values.null_count
        if skip >= present:  # a whole batch skipped without making Python strings
            skip -= present
            yield present, None
            continue
        for text in values.to_pylist():
            if text is None:
                continue
            if skip:
                skip -= 1
                yield 1, None
            else:
                yield 0, text


def parquet_documents(path: str, skip: int, field: str) -> Iterator[tuple[int, str | None]]:
    pa = _pyarrow(path)
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except OSError as e:  # ArrowInvalid (not Parquet) is a ValueError; a missing file an OSError
        raise ConfigError(f"cannot read data file {path}: {e.strerror or one_line(e)}") from None
    except (pa.ArrowException, ValueError) as e:
        raise ConfigError(f"cannot read Parquet file {path}: {one_line(e)}") from None
    _check_text_column(path, "Parquet file", parquet.schema_arrow, field)
    try:
        yield from _parquet_rows(path, parquet, skip, field)
    finally:
        parquet.close()


def _parquet_rows(path: str, parquet, skip: int, field: str) -> Iterator[tuple[int, str | None]]:
    import pyarrow as pa

    row_groups = list(range(parquet.metadata.num_row_groups))
    for index in _leading_groups(parquet, skip, field):  # whole row groups skipped unread, from metadata alone
        present = _present_rows(parquet, index, field)
        skip -= present
        row_groups.remove(index)
        yield present, None
    if not row_groups:
        return
    try:
        batches = parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=row_groups, columns=[field])
        yield from _column_documents((batch.column(0) for batch in batches), skip)
    except (OSError, pa.ArrowException, ValueError) as e:
        raise ConfigError(f"cannot read Parquet file {path}: {one_line(e)}") from None


def _present_rows(parquet, index: int, field: str) -> int:
    """Non-null values of the text column in a row group by its statistics; -1 where they do not say."""
    meta = parquet.metadata
    group = meta.row_group(index)
    for leaf in range(meta.num_columns):
        if meta.schema.column(leaf).path == field:
            stats = group.column(leaf).statistics
            if stats is not None and stats.has_null_count:
                return group.num_rows - stats.null_count
    return -1


def _leading_groups(parquet, skip: int, field: str) -> list[int]:
    """The first row groups that lie wholly within the first `skip` documents."""
    groups = []
    for index in range(parquet.metadata.num_row_groups):
        present = _present_rows(parquet, index, field)
        if present < 0 or present > skip:
            break
        groups.append(index)
        skip -= present
    return groups


def arrow_documents(path: str, skip: int, field: str) -> Iterator[tuple[int, str | None]]:
    """An Arrow IPC file: the stream format (what `datasets.save_to_disk` writes) or the file format."""
    pa = _pyarrow(path)
    try:
        source = pa.memory_map(path)
    except OSError as e:
        raise ConfigError(f"cannot read data file {path}: {e.strerror or one_line(e)}") from None
    bad = (OSError, pa.ArrowException, ValueError)
    try:
        try:
            if source.read(len(ARROW_FILE_MAGIC)) == ARROW_FILE_MAGIC:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                source.seek(0)
                reader = pa.ipc.open_stream(source)
                batches = iter(reader)
        except bad as e:
            raise ConfigError(f"cannot read Arrow file {path}: {one_line(e)}") from None
        _check_text_column(path, "Arrow file", reader.schema, field)
        index = reader.schema.get_field_index(field)
        try:
            yield from _column_documents((batch.column(index) for batch in batches), skip)
        except bad as e:
            raise ConfigError(f"cannot read Arrow file {path}: {one_line(e)}") from None
    finally:
        source.close()
