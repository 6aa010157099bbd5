# cython: language_level=3, boundscheck=False, wraparound=False
"""The hot path in C: `_core_py.py` is its readable reference, name for name."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_FromStringAndSize
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy

import orjson

from fastjobs._core_py import dump_args as _dump_args_py

IMPLEMENTATION = "c"

cdef object _dumps = orjson.dumps


cdef struct Buffer:
    char *data
    Py_ssize_t size
    Py_ssize_t capacity


cdef int _reserve(Buffer *buf, Py_ssize_t extra) except -1:
    cdef Py_ssize_t want = buf.size + extra
    cdef char *grown
    if want <= buf.capacity:
        return 0
    cdef Py_ssize_t capacity = buf.capacity * 2 if buf.capacity else 65536
    while capacity < want:
        capacity *= 2
    grown = <char *>realloc(buf.data, capacity)
    if grown == NULL:
        raise MemoryError()
    buf.data = grown
    buf.capacity = capacity
    return 0


cdef inline void _put(Buffer *buf, const char *src, Py_ssize_t n) noexcept:
    memcpy(buf.data + buf.size, src, n)
    buf.size += n


cdef inline void _put_int32(Buffer *buf, Py_ssize_t value) noexcept:
    cdef unsigned char *p = <unsigned char *>(buf.data + buf.size)
    p[0] = (value >> 24) & 0xFF
    p[1] = (value >> 16) & 0xFF
    p[2] = (value >> 8) & 0xFF
    p[3] = value & 0xFF
    buf.size += 4


def dump_args(kind, args, params, required):
    """Check one job's arguments against its handler and serialise them with orjson."""
    # The slow checks only run when the fast ones fail, and then the reference
    # produces the exact error message.
    if type(args) is dict and (params is None or params.issuperset(args)) and required.issubset(args):
        try:
            return _dumps(args)
        except TypeError:
            pass
    return _dump_args_py(kind, args, params, required)


def encode_copy_rows(str kind, rows, bytes prefix, bytes suffix, Py_ssize_t limit, params, frozenset required):
    """Encode up to `limit` rows of binary COPY data: prefix, the args as jsonb, suffix."""
    cdef Buffer buf
    cdef Py_ssize_t count = 0
    cdef Py_ssize_t n
    cdef bytes data
    cdef Py_ssize_t plen = PyBytes_GET_SIZE(prefix)
    cdef Py_ssize_t slen = PyBytes_GET_SIZE(suffix)
    buf.data = NULL
    buf.size = 0
    buf.capacity = 0
    try:
        for args in rows:
            data = dump_args(kind, args, params, required)
            n = PyBytes_GET_SIZE(data)
            _reserve(&buf, plen + 5 + n + slen)
            _put(&buf, PyBytes_AS_STRING(prefix), plen)
            _put_int32(&buf, n + 1)
            buf.data[buf.size] = 1  # jsonb binary format version
            buf.size += 1
            _put(&buf, PyBytes_AS_STRING(data), n)
            _put(&buf, PyBytes_AS_STRING(suffix), slen)
            count += 1
            if count == limit:
                break
        if buf.size == 0:
            return b"", 0
        return PyBytes_FromStringAndSize(buf.data, buf.size), count
    finally:
        free(buf.data)
