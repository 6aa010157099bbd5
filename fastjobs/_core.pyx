# cython: language_level=3, boundscheck=False, wraparound=False
"""The hot path in C: `_core_py.py` is its readable reference, name for name (its libpq calls, fast lane
and hand-back in `_libpq_py.py`, `_fast_lane_py.py` and `_hand_back_py.py`).

BatchLoop drives the connection psycopg opened through libpq directly
(`conn.pgconn.pgconn_ptr`, psycopg's documented seam): sound only because
psycopg uses this same system libpq, which fastjobs.impl checks at import.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport EINTR, errno
from cpython.object cimport PyObject_Call
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int16_t, int64_t, uint16_t, uint64_t
from libc.stdio cimport snprintf
from libc.stdlib cimport free, realloc
from libc.string cimport memcmp, memcpy, strerror

import inspect
import threading

import orjson

from fastjobs import guard, sql, stats
from fastjobs import outcomes
from fastjobs.abc import (BUCKETS_NS, COL_ARGS, COL_ATTEMPT, COL_CREATED_AT, COL_ID, COL_KEEP_RESULT,
                          COL_KIND, COL_MAX_ATTEMPTS, COL_META, COL_PRIORITY, COL_RUN_AT, COMPLETED,
                          FRONT_CLAIM_DUTY, HAND_BACK_AFTER, INT64_MAX, OBSERVED_MAX_NS, PG_EPOCH_US,
                          PICKUP_SUM, ROW, RUN_SUM)
from fastjobs.args import dump_args as _dump_args_checked
from fastjobs.errors import LoopError
from fastjobs.planner import Planner, fast_queues, takes_keys, widths


cdef extern from "libpq-fe.h" nogil:
    ctypedef struct PGconn:
        pass
    ctypedef struct PGresult:
        pass
    ctypedef enum ExecStatusType:
        PGRES_COMMAND_OK
        PGRES_TUPLES_OK
    PGresult *PQprepare(PGconn *conn, const char *name, const char *query, int nParams,
                        const unsigned int *types)
    int PQsendQuery(PGconn *conn, const char *query)
    int PQsendQueryPrepared(PGconn *conn, const char *name, int nParams, const char * const *values,
                            const int *lengths, const int *formats, int resultFormat)
    int PQflush(PGconn *conn)
    int PQconsumeInput(PGconn *conn)
    int PQisBusy(PGconn *conn)
    PGresult *PQgetResult(PGconn *conn)
    ExecStatusType PQresultStatus(const PGresult *res)
    char *PQresultErrorMessage(const PGresult *res)
    char *PQresultErrorField(const PGresult *res, int fieldcode)
    int PQgetisnull(const PGresult *res, int row, int column)
    char *PQerrorMessage(const PGconn *conn)
    int PQntuples(const PGresult *res)
    char *PQgetvalue(const PGresult *res, int row, int column)
    int PQgetlength(const PGresult *res, int row, int column)
    void PQclear(PGresult *res)
    int PQsocket(const PGconn *conn)


cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    enum:
        POLLIN
        POLLOUT


cdef extern from "<endian.h>" nogil:
    uint64_t be64toh(uint64_t)
    uint16_t be16toh(uint16_t)


IMPLEMENTATION = "c"

# The card's int64 fields the loop writes (fastjobs.stats.RUNNING_*), as C constants.
cdef enum:
    _RUNNING_JOB = 0
    _RUNNING_WRITING = 1
    _RUNNING_SUSPECT = 2
if (stats.RUNNING_JOB, stats.RUNNING_WRITING, stats.RUNNING_SUSPECT) != (0, 1, 2):
    raise ImportError("fastjobs.stats.RUNNING_* changed: rebuild _core with them")
# A claimed row's columns (fastjobs.abc.COL_*), as C constants.
cdef enum:
    _COL_ID = 0
    _COL_KIND = 1
    _COL_ARGS = 2
    _COL_ATTEMPT = 3
    _COL_MAX_ATTEMPTS = 4
    _COL_PRIORITY = 5
    _COL_RUN_AT = 6
    _COL_KEEP_RESULT = 7
    _COL_META = 8
    _COL_CREATED_AT = 9
if (COL_ID, COL_KIND, COL_ARGS, COL_ATTEMPT, COL_MAX_ATTEMPTS, COL_PRIORITY, COL_RUN_AT, COL_KEEP_RESULT,
        COL_META, COL_CREATED_AT) != tuple(range(10)):
    raise ImportError("fastjobs.abc.COL_* changed: rebuild _core with them")
cdef double _HAND_BACK_AFTER = HAND_BACK_AFTER
cdef double _INF = float("inf")
cdef object _dumps = orjson.dumps
cdef object _loads = orjson.loads
cdef object _JSONDecodeError = orjson.JSONDecodeError
cdef tuple _NO_ARGS = ()
cdef object _iscoroutine = inspect.iscoroutine
cdef object _release = outcomes.release
cdef object _discard = outcomes.discard
cdef object _unknown_kind = outcomes.unknown_kind
cdef object _tally = outcomes.tally
cdef object _cancelled = outcomes.cancelled
cdef object _completed = outcomes.completed
cdef object _kept = outcomes.kept
cdef object _encode = outcomes.encode
cdef object _isolate = outcomes.isolate
cdef object _say_stale = outcomes.say_stale
cdef object _started = outcomes.started
cdef object _say_rolled_back = outcomes.say_rolled_back
cdef frozenset _OUTCOME_ERROR_CLASSES = outcomes.OUTCOME_ERROR_CLASSES
cdef int _PG_DIAG_SQLSTATE = ord("C")
cdef object _outcome_column = stats.outcome_column
cdef object _count_slow = stats.count_slow
cdef object _kind_rows = stats.kind_rows
cdef Py_ssize_t _COMPLETED = COMPLETED
cdef Py_ssize_t _RUN_SUM = RUN_SUM
cdef Py_ssize_t _PICKUP_SUM = PICKUP_SUM
cdef Py_ssize_t _ROW = ROW
cdef int64_t _PG_EPOCH_US = PG_EPOCH_US
cdef int64_t _OBSERVED_MAX_NS = OBSERVED_MAX_NS
cdef int64_t _INT64_MAX = INT64_MAX
# The histograms' bucket bounds in ns (fastjobs.abc.BUCKETS), for a binary search per observation.
cdef enum:
    NBOUNDS = 24
cdef int64_t _BOUNDS[NBOUNDS]
if len(BUCKETS_NS) != NBOUNDS:
    raise ImportError("fastjobs.abc.BUCKETS changed: rebuild _core with its length as NBOUNDS")
for _i in range(NBOUNDS):
    _BOUNDS[_i] = BUCKETS_NS[_i]


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
    # The slow checks only run when the fast ones fail, and then fastjobs.args
    # (the Python implementation's dump_args) produces the exact error message.
    cdef bytes data
    if type(args) is dict and (params is None or params.issuperset(args)) and required.issubset(args):
        try:
            data = _dumps(args)
        except TypeError:
            pass
        else:
            if b"\\u0000" not in data:
                return data
    return _dump_args_checked(kind, args, params, required)


def encode_copy_rows(str kind, rows, bytes prefix, bytes suffix, Py_ssize_t limit, params,
                     frozenset required):
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


cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clock_id, timespec *tp)
    enum:
        CLOCK_MONOTONIC
        CLOCK_REALTIME


cdef inline double _monotonic() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


# clock_gettime is served by the vDSO: no syscall (about 20 ns here).
cdef inline int64_t _monotonic_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef inline int64_t _realtime_us() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_REALTIME, &ts)
    return <int64_t>ts.tv_sec * 1000000 + ts.tv_nsec // 1000


cdef inline void _observe(long long *cells, int64_t ns) noexcept nogil:
    """Add `ns` to the histogram whose sum is cells[0] (stats.observe): a binary search of the bounds."""
    cdef int lo = 0, hi = NBOUNDS, mid
    if ns < 0:
        ns = 0
    elif ns > _OBSERVED_MAX_NS:
        ns = _OBSERVED_MAX_NS
    while lo < hi:
        mid = (lo + hi) >> 1
        if _BOUNDS[mid] < ns:
            lo = mid + 1
        else:
            hi = mid
    cells[0] = cells[0] + ns if ns <= _INT64_MAX - cells[0] else _INT64_MAX
    cells[1 + lo] += 1


cdef inline int64_t _latency_ns(int64_t now_us, int64_t then_us) noexcept nogil:
    """now - then in ns, clamped before the multiplication could overflow (then: year 1 at worst)."""
    if then_us >= now_us:
        return 0
    if now_us - then_us > _OBSERVED_MAX_NS // 1000:
        return _OBSERVED_MAX_NS
    return (now_us - then_us) * 1000


cdef inline double _wallclock() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_REALTIME, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline int64_t _int8(const char *p) noexcept nogil:
    cdef uint64_t raw
    memcpy(&raw, p, 8)
    return <int64_t>be64toh(raw)


cdef inline int16_t _int2(const char *p) noexcept nogil:
    cdef uint16_t raw
    memcpy(&raw, p, 2)
    return <int16_t>be16toh(raw)


cdef int _wait(PGconn *conn, short events, bint quiet) except -1:
    cdef pollfd pfd
    cdef int rc
    pfd.fd = PQsocket(conn)
    pfd.events = events
    while True:
        pfd.revents = 0
        with nogil:
            rc = poll(&pfd, 1, -1)
        if rc >= 0:
            return 0
        if errno != EINTR:
            raise OSError(errno, strerror(errno).decode())
        # A signal arrived: run its Python handler (which may raise), then wait on; or,
        # `quiet` (the fast lane's transaction begins or ends), leave it for later.
        if not quiet:
            PyErr_CheckSignals()


cdef str _conn_error(PGconn *conn):
    return PQerrorMessage(conn).decode("utf-8", "replace")


cdef class BatchLoop:
    """Claims, runs and completes batches on one connection, one statement per batch.

    See the reference in _core_py.py for the overlap and the adaptive batch size.
    """

    cdef PGconn *_pgconn
    cdef object _conn  # keeps psycopg's connection (owner of the PGconn) alive
    cdef object _catalogue  # fastjobs.sql.of(the app's schema): where the statements come from
    cdef dict _specs
    cdef object _executor
    cdef bytes _worker_id
    cdef list _queues
    # The per-batch decisions (fastjobs.planner): which queue, lane, size, from where.
    cdef readonly object planner
    cdef bytes _statement, _after_statement
    cdef bytes _sql, _after_sql
    # The _results variants: outcomes go by them while the planner's keeping is set.
    cdef bytes _kept_statement, _kept_after_statement
    cdef bytes _kept_sql, _kept_after_sql
    # In a queue without keyed jobs (planner.keyless), the job_complete_claim_ variants: outcomes
    # go by them when all are completions at a first attempt; the job_claim_only_ ones: the claim
    # goes by them when there is no outcome to send.
    cdef bytes _complete_statement, _complete_after_statement
    cdef bytes _complete_sql, _complete_after_sql
    cdef bytes _claim_statement, _claim_after_statement
    cdef bytes _claim_sql, _claim_after_sql
    # The complete and claim-only statements after the mark in slot 0 and one rotating slot alone
    # (sql.IN_SLOT), and the slot the claim in flight reads so (0: every slot).
    cdef bytes _complete_slot_statement, _complete_slot_sql, _claim_slot_statement, _claim_slot_sql
    cdef long _sent_slot
    cdef public bint overlap, stopping
    cdef public Py_ssize_t claimed, completed, failed, retried, discarded, stale
    cdef bint _in_flight
    cdef Py_ssize_t _limit
    cdef PGresult *_rows
    cdef int _nrows
    # Jobs completed at their first attempt (by id; every other outcome is a
    # record in _failures) gathered for the next statement, and those of the
    # statement in flight (swapped at each send), isolated if PostgreSQL rejects it.
    cdef int64_t *_done
    cdef Py_ssize_t _ndone, _done_cap
    cdef int64_t *_sent_done
    cdef Py_ssize_t _nsent, _sent_cap
    cdef list _failures
    cdef list _sent_failures
    cdef char *_text
    cdef Py_ssize_t _text_cap
    # Cache of the last kind seen: batches are mostly one kind, and a memcmp
    # beats building a str and a dict lookup per job.
    cdef bytes _last_kind
    cdef object _last_spec
    cdef object _last_func
    cdef object _last_kind_str
    # The executor's JobContext (updated in place per sync job) and its set of
    # job ids whose cancellation arrived, filled by the control thread.
    cdef object _context
    cdef set _cancelled
    cdef bint _last_fast
    cdef bint _pooled  # this batch's sync jobs run on the executor's pool (set per batch)
    # Shared memory written per job started (plain stores, no syscall): a
    # float64 count, so the master can tell a long batch from a hung one, and
    # the job's id, so it knows which job a dead worker was running; per
    # statement, the failed jobs' outcomes it carries (see the reference).
    cdef double[::1] _progress_view
    cdef double *_progress
    cdef long long[::1] _running_view
    cdef long long *_running
    cdef bint _write_failed
    # Counts per (queue, kind) in the card (see the reference): the cached
    # kind's row offset, the batch's queue's first row, a queue's span.
    cdef long long[::1] _counts_view
    cdef long long *_counts
    cdef dict _kind_rows, _slow_rows
    cdef object _counts_obj
    cdef Py_ssize_t _other, _stride, _batch_base, _last_row
    # With full context (the app has middleware) the claim returns meta and
    # created_at too and each JobContext is filled whole (see the reference).
    cdef bint _whole_context
    cdef str _queue_name
    # The fast lane: whether a fast batch's transaction is open, and when that
    # batch stops starting jobs.
    cdef bint _tx
    cdef double _deadline
    cdef bytes _lock_statement, _lock_sql, _lock_after_statement, _lock_after_sql
    cdef public Py_ssize_t fast
    # What the guard reads while a handler runs (see the reference): since
    # when, the batch and the index of the job running (-1: the executor's
    # phase), the slow jobs set aside; what it did. Its thread holds
    # _guard_lock while it acts; _handing is set with the GIL held right
    # after it saw _job_began set, and this thread clears _job_began and
    # reads _handing with the GIL held too: with no call between, the two
    # pairs cannot interleave, so a handler's return costs two plain stores
    # and a load, and the lock is taken only when a hand-back is under way.
    cdef object _guard_lock
    cdef double _job_began
    cdef PGresult *_batch
    cdef int _batch_n, _at
    cdef list _slow
    cdef bint _handed, _handing
    cdef bint _quiet  # the fast lane's transaction begins or ends: waits run no signal handler
    cdef object _guard_error
    cdef object __weakref__  # fastjobs.guard holds loops weakly

    def __cinit__(self):
        self._pgconn = NULL
        self._progress = NULL
        self._running = NULL
        self._counts = NULL
        self._rows = NULL
        self._batch = NULL
        self._done = NULL
        self._sent_done = NULL
        self._text = NULL

    def __init__(self, conn, dict specs, executor, str worker_id, list queues, bint keep_completed=False,
                 Py_ssize_t batch_min=1, Py_ssize_t batch_max=1000, bint overlap=True, progress=None,
                 double front_claim_duty=FRONT_CLAIM_DUTY, running=None, counts=None,
                 bint whole_context=False, bint fast_lane=False, sql=sql):  # no-cython-lint: module default
        self._conn = conn
        self._catalogue = sql  # the statements of the app's schema
        self._pgconn = <PGconn *><size_t>conn.pgconn.pgconn_ptr
        self._specs = {k.encode(): v for k, v in specs.items()}
        self._executor = executor
        self._context = executor.context
        self._cancelled = executor.cancelled
        self._worker_id = worker_id.encode()
        self._queues = [q.encode() for q in queues]
        self._whole_context = whole_context
        self._queue_name = None
        finish = sql.FINISH_CONTEXT if whole_context else sql.FINISH
        name, text = finish[bool(keep_completed), False]
        self._statement, self._sql = name.encode(), text.encode()
        name, text = finish[bool(keep_completed), True]
        self._after_statement, self._after_sql = name.encode(), text.encode()
        kept = sql.FINISH_CONTEXT_RESULTS if whole_context else sql.FINISH_RESULTS
        name, text = kept[bool(keep_completed), False]
        self._kept_statement, self._kept_sql = name.encode(), text.encode()
        name, text = kept[bool(keep_completed), True]
        self._kept_after_statement, self._kept_after_sql = name.encode(), text.encode()
        complete = sql.COMPLETE_CONTEXT if whole_context else sql.COMPLETE
        name, text = complete[bool(keep_completed), False]
        self._complete_statement, self._complete_sql = name.encode(), text.encode()
        name, text = complete[bool(keep_completed), True]
        self._complete_after_statement, self._complete_after_sql = name.encode(), text.encode()
        claim = sql.CLAIM_ONLY_CONTEXT if whole_context else sql.CLAIM_ONLY
        name, text = claim[bool(keep_completed), False]
        self._claim_statement, self._claim_sql = name.encode(), text.encode()
        name, text = claim[bool(keep_completed), True]
        self._claim_after_statement, self._claim_after_sql = name.encode(), text.encode()
        name, text = complete[bool(keep_completed), sql.IN_SLOT]
        self._complete_slot_statement, self._complete_slot_sql = name.encode(), text.encode()
        name, text = claim[bool(keep_completed), sql.IN_SLOT]
        self._claim_slot_statement, self._claim_slot_sql = name.encode(), text.encode()
        self._sent_slot = 0
        self.planner = Planner(
            fast_queues(specs, queues, fast_lane=fast_lane, keep_completed=keep_completed),
            batch_min=batch_min, batch_max=batch_max, duty=front_claim_duty,
            pooled=lambda index: bool(executor.threads) and executor.pooled(self._queues[index]),
            widths=widths(specs, queues, executor.concurrency, executor.threads))
        keys = takes_keys(specs)
        name, text = sql.LOCK[bool(whole_context), False, keys]
        self._lock_statement, self._lock_sql = name.encode(), text.encode()
        name, text = sql.LOCK[bool(whole_context), True, keys]
        self._lock_after_statement, self._lock_after_sql = name.encode(), text.encode()
        self._tx = False
        self._deadline = 0.0
        self.fast = 0
        self._guard_lock = threading.Lock()
        self._job_began = 0.0
        self._batch_n = 0
        self._at = -1
        self._slow = []
        self._handed = self._handing = False
        self._quiet = False
        self._guard_error = None
        self.overlap = overlap
        self.stopping = False
        self._pooled = False
        self.claimed = self.completed = self.failed = self.retried = self.discarded = self.stale = 0
        self._in_flight = False
        self._limit = 0
        self._nrows = 0
        self._write_failed = False
        self._ndone = 0
        self._done_cap = 0
        self._nsent = 0
        self._sent_cap = 0
        self._failures = []
        self._sent_failures = []
        self._text_cap = 0
        self._last_kind = None
        if (progress is None) != (running is None):
            raise ValueError("progress and running are the one card's: pass both or neither")
        if running is not None:
            self._progress_view = progress
            self._progress = &self._progress_view[0]
            self._running_view = running
            self._running = &self._running_view[0]
        self._slow_rows, self._other = _kind_rows(specs)
        self._kind_rows = {k.encode(): v for k, v in self._slow_rows.items()}
        self._stride = self._other + _ROW
        self._batch_base = self._last_row = 0
        if counts is not None and len(counts) < len(queues) * self._stride:
            # The master lays the card out from its own plan: stores past its end would land
            # in the next card. A kind registered after it planned is such a mismatch.
            raise ValueError(f"the counts view holds {len(counts)} cells; these queues and kinds"
                             f" need {len(queues) * self._stride}")
        if counts is not None and len(counts):
            self._counts_obj = counts
            self._counts_view = counts
            self._counts = &self._counts_view[0]

    def __dealloc__(self):
        if self._rows != NULL:
            PQclear(self._rows)
        free(self._done)
        free(self._sent_done)
        free(self._text)

    # The planner's figures the worker reads and its careful mode sets.
    @property
    def batch_min(self):
        return self.planner.batch_min

    @batch_min.setter
    def batch_min(self, value):
        self.planner.batch_min = value

    @property
    def batch_max(self):
        return self.planner.batch_max

    @batch_max.setter
    def batch_max(self, value):
        self.planner.batch_max = value

    @property
    def size(self):
        return self.planner.size

    @property
    def recheck(self):
        return self.planner.recheck

    cpdef double due(self):
        if self._handed:
            return 0.0
        if self._tx:
            return self._deadline
        return self._job_began + _HAND_BACK_AFTER if self._job_began != 0.0 else 0.0

    def prepare(self, bint plan_ahead=False):
        statements = [
            (self._statement, self._sql), (self._after_statement, self._after_sql),
            (self._kept_statement, self._kept_sql), (self._kept_after_statement, self._kept_after_sql),
            (self._complete_statement, self._complete_sql),
            (self._complete_after_statement, self._complete_after_sql),
            (self._claim_statement, self._claim_sql), (self._claim_after_statement, self._claim_after_sql),
            (self._complete_slot_statement, self._complete_slot_sql),
            (self._claim_slot_statement, self._claim_slot_sql),
        ]
        if self.planner.any_fast:
            statements += [(self._lock_statement, self._lock_sql),
                           (self._lock_after_statement, self._lock_after_sql)]
            statements += [(name.encode(), self._catalogue.STATEMENTS[name].encode()) for name in (
                "job_finish_locked_many", "job_finish_locked_many_results", "job_hand_over", "queue_wake")]
        for name, text in statements:
            self._prepare(name, text)
        if plan_ahead:
            ahead = self._catalogue.plan_ahead([(n.decode(), text.decode()) for n, text in statements])
            self._simple(ahead.encode())
        guard.watch(self)

    cdef int _simple(self, bytes text) except -1:
        """Run statements without parameters (the fast lane's BEGIN, COMMIT, ROLLBACK; sql.plan_ahead's)."""
        cdef PGresult *res
        cdef ExecStatusType status
        cdef str error = None
        if not PQsendQuery(self._pgconn, text):
            raise LoopError(_conn_error(self._pgconn))
        self._flush()
        if not PQconsumeInput(self._pgconn):
            raise LoopError(_conn_error(self._pgconn))
        while True:
            while PQisBusy(self._pgconn):
                _wait(self._pgconn, POLLIN, self._quiet)
                if not PQconsumeInput(self._pgconn):
                    raise LoopError(_conn_error(self._pgconn))
            res = PQgetResult(self._pgconn)
            if res == NULL:
                break
            status = PQresultStatus(res)
            if status != PGRES_COMMAND_OK and status != PGRES_TUPLES_OK and error is None:
                error = PQresultErrorMessage(res).decode("utf-8", "replace")
            PQclear(res)
        if error is not None:
            raise LoopError(error)
        return 0

    cdef int _lock(self) except -1:
        """The fast lane's claim (see the reference): rows to self._rows, the transaction left open."""
        cdef Py_ssize_t index, limit
        cdef int n
        cdef object mark
        if self._ndone or self._failures:
            self._send()
            self._receive()
        if self._rows != NULL:
            PQclear(self._rows)
            self._rows = NULL
        self._nrows = 0
        index, limit, mark = self.planner.next()
        self._quiet = True  # see _commit
        try:
            n = self._begin_lock(limit, index, mark)
        finally:
            self._quiet = False
        self._plan(n)
        self._nrows = n
        self.claimed += n
        return 0

    cdef int _begin_lock(self, Py_ssize_t limit, Py_ssize_t index, object mark) except -1:
        """BEGIN and the lock's claim (rows to self._rows); COMMIT at once when it found none."""
        cdef char limit_text[24]
        cdef char priority_text[8]
        cdef char run_at_text[24]
        cdef const char *values[4]
        cdef list error = []
        cdef int n, rc
        self._simple(b"BEGIN")
        snprintf(limit_text, sizeof(limit_text), "%zd", limit)
        values[0] = PyBytes_AS_STRING(self._queues[index])
        values[1] = limit_text
        if mark is None:
            rc = PQsendQueryPrepared(self._pgconn, self._lock_statement, 2, values, NULL, NULL, 1)
        else:
            snprintf(priority_text, sizeof(priority_text), "%d", <int>mark[0])
            snprintf(run_at_text, sizeof(run_at_text), "%lld", <long long>mark[1])
            values[2] = priority_text
            values[3] = run_at_text
            rc = PQsendQueryPrepared(self._pgconn, self._lock_after_statement, 4, values, NULL, NULL, 1)
        if not rc:
            raise LoopError(_conn_error(self._pgconn))
        self._flush()
        self._rows = self._results(error)
        if error:
            try:
                self._simple(b"ROLLBACK")
            except LoopError:
                pass
            raise LoopError(error[0])
        n = PQntuples(self._rows)
        if n:
            self._tx = True
        else:
            self._simple(b"COMMIT")
        return n

    cdef int _commit(self, bint wake=False) except -1:
        """Write the fast batch's outcomes in its transaction and commit it (see the reference).

        From the moment its outcomes leave the lists until the reply to its
        COMMIT is read, no Python code runs, and its waits run no signal
        handler (_quiet): a stop-now raised there would leave the batch's
        transaction half-ended (see the reference's _quiet).
        """
        cdef const char *values[3]
        cdef list error = []
        cdef list failures = _started(self._failures)
        cdef Py_ssize_t ndone = self._ndone
        cdef PGresult *res
        cdef bytes encoded = _encode(failures)
        cdef bytes queue = self._queues[self._batch_base // self._stride]
        wake = wake or len(failures) < len(self._failures)
        self._literal(ndone, self._done)
        del self._failures[:]
        self._ndone = 0
        self._tx = False
        self._writing(failures)
        values[0] = self._text
        values[1] = PyBytes_AS_STRING(encoded)
        values[2] = PyBytes_AS_STRING(self._worker_id)
        self._quiet = True
        try:
            if not PQsendQueryPrepared(
                    self._pgconn,
                    b"job_finish_locked_many_results" if self.planner.keeping else b"job_finish_locked_many",
                    3, values, NULL, NULL, 1):
                raise LoopError(_conn_error(self._pgconn))
            self._flush()
            res = self._results(error)
            if res != NULL:
                PQclear(res)
            if not error and wake:
                values[0] = PyBytes_AS_STRING(queue)
                if not PQsendQueryPrepared(self._pgconn, b"queue_wake", 1, values, NULL, NULL, 1):
                    raise LoopError(_conn_error(self._pgconn))
                self._flush()
                res = self._results(error)
                if res != NULL:
                    PQclear(res)
            self._simple(b"ROLLBACK" if error else b"COMMIT")
        finally:
            self._quiet = False
        if error:
            self.planner.demote(self._batch_base // self._stride)
            _say_rolled_back(ndone + len(failures), error[0])
        else:
            self.completed += ndone
            if failures:
                completed, failed, retried, discarded = _tally(failures)
                self.completed += completed
                self.failed += failed
                self.retried += retried
                self.discarded += discarded
            self.fast += ndone + len(failures)
        self._written()
        return 0

    cdef int _writing(self, list failures) except -1:
        """Note in the card the failed jobs' outcomes the statement about to be sent carries."""
        if self._running != NULL and not self._write_failed:
            self._running[_RUNNING_WRITING] = len(failures)
            if failures:
                self._running[_RUNNING_SUSPECT] = failures[0]["id"]
        return 0

    cdef int _written(self) except -1:
        if self._running != NULL and not self._write_failed:
            self._running[_RUNNING_WRITING] = 0
        return 0

    cdef int _prepare(self, bytes name, bytes text) except -1:
        cdef PGresult *res = PQprepare(self._pgconn, name, text, 0, NULL)
        if res == NULL:
            raise LoopError(_conn_error(self._pgconn))
        try:
            if PQresultStatus(res) != PGRES_COMMAND_OK:
                raise LoopError(PQresultErrorMessage(res).decode("utf-8", "replace"))
        finally:
            PQclear(res)
        return 0

    cdef int _add_done(self, int64_t job_id, int attempt) except -1:
        """A job completed: its id when at its first attempt, else an outcome record (see sql)."""
        cdef int64_t *grown
        if attempt != 1:
            self._failures.append(_completed(job_id, attempt))
            return 0
        if self._ndone == self._done_cap:
            self._done_cap = self._done_cap * 2 if self._done_cap else 1024
            grown = <int64_t *>realloc(self._done, self._done_cap * sizeof(int64_t))
            if grown == NULL:
                raise MemoryError()
            self._done = grown
        self._done[self._ndone] = job_id
        self._ndone += 1
        return 0

    cdef int _literal(self, Py_ssize_t count, int64_t *ids) except -1:
        """The ids as an int8[] literal, {1,2,3}, in self._text; 21 bytes bound each."""
        cdef Py_ssize_t i, pos = 0
        cdef Py_ssize_t need = 2 + count * 21
        cdef char *grown
        if need > self._text_cap:
            grown = <char *>realloc(self._text, need + 1)
            if grown == NULL:
                raise MemoryError()
            self._text = grown
            self._text_cap = need
        self._text[pos] = b"{"
        pos += 1
        for i in range(count):
            if i:
                self._text[pos] = b","
                pos += 1
            pos += snprintf(self._text + pos, 21, "%lld", <long long>ids[i])
        self._text[pos] = b"}"
        self._text[pos + 1] = 0
        return 0

    cdef int _send(self, Py_ssize_t index=0, Py_ssize_t limit=0, object mark=None) except -1:
        """Send the outcomes gathered so far and a claim: the planner's next (none by default)."""
        cdef char limit_text[24]
        cdef char priority_text[8]
        cdef char run_at_text[24]
        cdef char slot_text[8]
        cdef const char *values[8]
        cdef bytes failures
        cdef int rc
        cdef int64_t *ids
        cdef Py_ssize_t cap
        # A queue's claims that must take keyed jobs go by the statements that write records too.
        cdef bint records = bool(self._failures) or not self.planner.keyless(index)
        cdef bint sending = records or self._ndone > 0
        self._literal(self._ndone, self._done)
        self._writing(self._failures)
        failures = _encode(self._failures)
        snprintf(limit_text, sizeof(limit_text), "%zd", limit)
        self.completed += self._ndone
        if self._failures:
            completed, failed, retried, discarded = _tally(self._failures)
            self.completed += completed
            self.failed += failed
            self.retried += retried
            self.discarded += discarded
        # Swap the gathered outcomes with the (empty) in-flight ones: kept until the result comes back.
        ids, cap = self._sent_done, self._sent_cap
        self._sent_done, self._sent_cap = self._done, self._done_cap
        self._done, self._done_cap = ids, cap
        self._nsent = self._ndone
        self._ndone = 0
        self._sent_failures = self._failures
        self._failures = []
        values[0] = self._text
        values[1] = PyBytes_AS_STRING(failures)
        values[2] = PyBytes_AS_STRING(self._queues[index])
        values[3] = limit_text
        values[4] = PyBytes_AS_STRING(self._worker_id)
        keeping = self.planner.keeping
        self._sent_slot = 0
        if mark is None:
            rc = PQsendQueryPrepared(
                self._pgconn,
                self._claim_statement if not sending else self._kept_statement if keeping
                else self._statement if records else self._complete_statement,
                5, values, NULL, NULL, 1)
        else:
            snprintf(priority_text, sizeof(priority_text), "%d", <int>mark[0])
            snprintf(run_at_text, sizeof(run_at_text), "%lld", <long long>mark[1])
            values[5] = priority_text
            values[6] = run_at_text
            if mark[2] and (not sending or not (keeping or records)):  # the claim and complete ones
                self._sent_slot = mark[2]
                snprintf(slot_text, sizeof(slot_text), "%ld", self._sent_slot)
                values[7] = slot_text
                rc = PQsendQueryPrepared(
                    self._pgconn,
                    self._claim_slot_statement if not sending else self._complete_slot_statement,
                    8, values, NULL, NULL, 1)
            else:
                rc = PQsendQueryPrepared(
                    self._pgconn,
                    self._claim_after_statement if not sending else self._kept_after_statement if keeping
                    else self._after_statement if records else self._complete_after_statement,
                    7, values, NULL, NULL, 1)
        if not rc:
            raise LoopError(_conn_error(self._pgconn))
        self._flush()
        self._in_flight = True
        self._limit = limit
        return 0

    cdef int _flush(self) except -1:
        cdef int rc
        while True:
            rc = PQflush(self._pgconn)
            if rc == 0:
                break
            if rc < 0:
                raise LoopError(_conn_error(self._pgconn))
            _wait(self._pgconn, POLLIN | POLLOUT, self._quiet)
            if not PQconsumeInput(self._pgconn):
                raise LoopError(_conn_error(self._pgconn))
        return 0

    cdef PGresult *_results(self, list error) except? NULL:
        """The in-flight statement's rows, or NULL with [message, whether an outcome is why] in `error`."""
        cdef PGresult *res
        cdef PGresult *rows = NULL
        cdef const char *state
        if not PQconsumeInput(self._pgconn):
            self._in_flight = False
            raise LoopError(_conn_error(self._pgconn))
        while True:
            while PQisBusy(self._pgconn):
                _wait(self._pgconn, POLLIN, self._quiet)
                if not PQconsumeInput(self._pgconn):
                    self._in_flight = False
                    if rows != NULL:
                        PQclear(rows)
                    raise LoopError(_conn_error(self._pgconn))
            res = PQgetResult(self._pgconn)
            if res == NULL:
                break
            if PQresultStatus(res) == PGRES_TUPLES_OK and not error:
                if rows != NULL:
                    PQclear(rows)
                rows = res
            else:
                if not error:
                    state = PQresultErrorField(res, _PG_DIAG_SQLSTATE)
                    error.append(PQresultErrorMessage(res).decode("utf-8", "replace"))
                    error.append(state != NULL
                                 and state[:2].decode("ascii", "replace") in _OUTCOME_ERROR_CLASSES)
                PQclear(res)
        self._in_flight = False
        if error and rows != NULL:
            PQclear(rows)
            rows = NULL
        if not error and rows == NULL:
            error.extend((_conn_error(self._pgconn), False))
        return rows

    cdef int _claimed(self, PGresult *res) except -1:
        """How many rows of `res` are claimed jobs; the stale outcomes after them are counted and logged,
        and the slot row a claim after the mark ends with goes to the planner (see the reference)."""
        cdef int n = PQntuples(res)
        cdef list stale
        cdef str state
        if n and PQgetisnull(res, n - 1, _COL_KIND) and PQgetisnull(res, n - 1, _COL_ARGS):
            n -= 1  # the slot row a claim after the mark ends with (sql._slot_row)
            self.planner.slots(_int2(PQgetvalue(res, n, _COL_ATTEMPT)),
                               _int8(PQgetvalue(res, n, _COL_RUN_AT)), self._sent_slot)
        elif self._sent_slot:  # a claim in one slot returns none while its slot is current
            self.planner.slots(0, 0, self._sent_slot)
        self._sent_slot = 0
        if n and PQgetisnull(res, n - 1, _COL_KIND):
            stale = []
            while n and PQgetisnull(res, n - 1, _COL_KIND):
                n -= 1
                # jsonb's binary format: a version byte, then the JSON text.
                state = _loads(PQgetvalue(res, n, _COL_ARGS)[1:PQgetlength(res, n, _COL_ARGS)])
                stale.append((_int8(PQgetvalue(res, n, _COL_ID)), _int2(PQgetvalue(res, n, _COL_ATTEMPT)),
                              state))
                if state == "completed":
                    self.completed -= 1
            self.stale += len(stale)
            _say_stale(stale[::-1])
        return n

    def _write(self, list done, list failures):
        """Write outcomes alone, claiming nothing; the error if one of them is rejected."""
        cdef Py_ssize_t i, count = len(done)
        cdef int64_t *ids = <int64_t *>realloc(NULL, (count + 1) * sizeof(int64_t))
        cdef const char *values[5]
        cdef bytes encoded
        cdef list error = []
        cdef PGresult *res
        try:
            if ids == NULL:
                raise MemoryError()
            for i in range(count):
                ids[i] = done[i]
            self._literal(count, ids)
        finally:
            free(ids)
        encoded = _encode(failures)
        values[0] = self._text
        values[1] = PyBytes_AS_STRING(encoded)
        values[2] = PyBytes_AS_STRING(self._queues[0])
        values[3] = b"0"
        values[4] = PyBytes_AS_STRING(self._worker_id)
        # A hand-back's or isolation's write: rare, and never unkept (see the reference).
        if not PQsendQueryPrepared(self._pgconn, self._kept_statement, 5, values, NULL, NULL, 1):
            raise LoopError(_conn_error(self._pgconn))
        self._flush()
        res = self._results(error)
        if res != NULL:
            try:
                self._claimed(res)
            finally:
                PQclear(res)
            return None
        if not error[1]:
            raise LoopError(error[0])
        return error[0]

    cdef int _receive(self) except -1:
        """Collect the in-flight statement's result: the claimed rows go to self._rows."""
        cdef list error = []
        cdef int n
        cdef Py_ssize_t i
        cdef list failures
        if self._rows != NULL:
            PQclear(self._rows)
            self._rows = NULL
        self._nrows = 0
        self._rows = self._results(error)
        if error:
            failures, self._sent_failures = self._sent_failures, []
            if not (error[1] and (self._nsent or failures)):
                self._nsent = 0
                self._write_failed = True
                raise LoopError(error[0])
            # One outcome made PostgreSQL reject the statement, claim and
            # all: write the outcomes apart, then carry on with nothing claimed.
            done = [self._sent_done[i] for i in range(self._nsent)]
            self._nsent = 0
            _isolate(self._write, done, failures, error[0])
        self._nsent = 0
        self._sent_failures = []
        self._written()
        self._nrows = self._claimed(self._rows) if self._rows != NULL else 0
        n = self._nrows
        self.claimed += n
        if self._limit > 0:
            self._plan(n)
        return 0

    cdef int _plan(self, int n) except -1:
        """Tell the planner what the claim found (see the reference)."""
        cdef int i, priority, lowest = 1 << 15
        cdef int64_t run_at, latest = 0
        cdef bint keeps = False
        for i in range(n):
            priority = _int2(PQgetvalue(self._rows, i, _COL_PRIORITY))
            run_at = _int8(PQgetvalue(self._rows, i, _COL_RUN_AT))
            if priority < lowest:
                lowest, latest = priority, run_at
            elif priority == lowest and run_at > latest:
                latest = run_at
            if not keeps and not PQgetisnull(self._rows, i, _COL_KEEP_RESULT):
                keeps = True
        self.planner.claimed(n, lowest, latest, keeps)
        return 0

    cdef int _claim(self) except -1:
        """Claim synchronously, trying each queue once (the planner's tries) before giving up."""
        cdef object planner = self.planner
        for _ in range(planner.tries(bool(self._failures))):
            if planner.lane():
                self._lock()
                if not self._nrows and planner.again():
                    index, limit, mark = planner.next()
                    self._send(index, limit, mark)
                    self._receive()
            else:
                index, limit, mark = planner.next()
                self._send(index, limit, mark)
                self._receive()
            if self._nrows:
                return 0
        return 0

    def step(self):
        """Run one batch; 0 when there was nothing to claim (outcomes are flushed then)."""
        cdef PGresult *batch
        cdef int n
        cdef double began
        cdef Py_ssize_t index
        cdef object planner = self.planner
        planner.recheck = _INF
        if self._nrows == 0:
            self._claim()
            if self._nrows == 0:
                return 0
        index = planner.index
        queue = self._queues[index]
        self._executor.queue = queue  # the rows' queue, for the records of failures
        self._pooled = bool(self._executor.threads) and self._executor.pooled(queue)
        self._batch_base = index * self._stride
        if self._whole_context:
            self._queue_name = queue.decode()
        # Take ownership of the claimed rows: _receive below fills self._rows anew.
        batch = self._rows
        n = self._nrows
        self._rows = NULL
        self._nrows = 0
        self._batch, self._batch_n, self._handed = batch, n, False
        if self._tx:
            # A fast-lane batch: no claim ahead, a deadline, its outcomes committed (see the reference).
            try:
                began = _monotonic()
                self._deadline = planner.deadline()
                guard.alert(self._deadline)
                try:
                    self._run(batch, n)
                finally:
                    if self._tx:
                        self._commit()
                planner.ran_fast(index, n, _monotonic() - began)
            finally:
                self._batch = NULL
                PQclear(batch)
            return n
        try:
            if planner.ahead(self.overlap, self.stopping):
                claim_index, limit, mark = planner.next()
                self._send(claim_index, limit, mark)
            began = _monotonic()
            self._run(batch, n)
            wave, self._executor.wave = self._executor.wave, 0
            planner.ran(index, n, _monotonic() - began, wave, self._pooled, self._in_flight)
        finally:
            self._batch = NULL
            PQclear(batch)
        if self._in_flight:
            self._receive()
        return n

    def finish(self):
        """Give back the batch claimed ahead and write every outcome still held."""
        cdef int i
        if self._tx:
            self._commit()
        if self._in_flight:
            self._receive()
        for i in range(self._nrows):
            self._failures.append(_release(_int8(PQgetvalue(self._rows, i, _COL_ID)),
                                           _int2(PQgetvalue(self._rows, i, _COL_ATTEMPT))))
        if self._rows != NULL:
            PQclear(self._rows)
            self._rows = NULL
        self._nrows = 0
        if self._ndone or self._failures:
            self._send()
            self._receive()

    cdef int _run(self, PGresult *rows, int n) except -1:
        cdef int i, j
        cdef int64_t job_id
        cdef int attempt, max_attempts
        cdef const char *kind
        cdef int kind_len
        cdef const char *raw
        cdef int raw_len
        cdef object spec, args, result, meta
        cdef tuple claimed = None
        cdef list failures = self._failures
        cdef list slow = []
        cdef object context = self._context
        self._slow = slow
        # The batch's row of the cached kind, NULL when no counts are kept;
        # the claim's time on run_at's clock (microseconds since 2000).
        cdef long long *row = NULL
        cdef int64_t claimed_us = 0, began = 0
        cdef bint fast = self._tx
        if self._counts != NULL:
            claimed_us = _realtime_us() - _PG_EPOCH_US
        if self._executor.keeping:
            self._executor.keeping.clear()
        for i in range(n):
            job_id = _int8(PQgetvalue(rows, i, _COL_ID))
            if self.stopping or (fast and _monotonic() > self._deadline):
                if not self.stopping:
                    # Jobs slower than the queue's pace: see the reference.
                    self.planner.demote(self._batch_base // self._stride)
                for j in range(i, n):
                    failures.append(_release(_int8(PQgetvalue(rows, j, _COL_ID)),
                                             _int2(PQgetvalue(rows, j, _COL_ATTEMPT))))
                break
            if self._running != NULL:
                self._progress[0] += 1
                self._running[_RUNNING_JOB] = job_id
            kind = PQgetvalue(rows, i, _COL_KIND)
            kind_len = PQgetlength(rows, i, _COL_KIND)
            attempt = _int2(PQgetvalue(rows, i, _COL_ATTEMPT))
            max_attempts = _int2(PQgetvalue(rows, i, _COL_MAX_ATTEMPTS))
            if (self._last_kind is None or PyBytes_GET_SIZE(self._last_kind) != kind_len
                    or memcmp(PyBytes_AS_STRING(self._last_kind), kind, kind_len) != 0):
                self._last_kind = PyBytes_FromStringAndSize(kind, kind_len)
                self._last_spec = self._specs.get(self._last_kind)
                if self._counts != NULL:
                    self._last_row = self._kind_rows.get(self._last_kind, self._other)
                if self._last_spec is not None:
                    self._last_func = self._last_spec.target
                    self._last_kind_str = self._last_spec.kind
                    self._last_fast = not self._last_spec.is_async and self._last_spec.timeout is None
            if self._counts != NULL:
                row = self._counts + self._batch_base + self._last_row
                _observe(row + _PICKUP_SUM, _latency_ns(claimed_us, _int8(PQgetvalue(rows, i, _COL_RUN_AT))))
            spec = self._last_spec
            if spec is None:
                failures.append(self._tally(row, _unknown_kind(
                    job_id, PyUnicode_DecodeUTF8(kind, kind_len, "replace"), attempt, max_attempts,
                    self._specs.values())))
                continue
            # jsonb's binary format: a version byte, then the JSON text.
            raw = PQgetvalue(rows, i, _COL_ARGS)
            raw_len = PQgetlength(rows, i, _COL_ARGS)
            try:
                args = _loads(PyBytes_FromStringAndSize(raw + 1, raw_len - 1))
            except _JSONDecodeError as exc:
                failures.append(self._tally(row, _discard(job_id, attempt, f"args do not decode: {exc}")))
                continue
            if type(args) is not dict:
                failures.append(self._tally(row, _discard(
                    job_id, attempt, f"args must be a JSON object, not {type(args).__name__}")))
                continue
            if self._whole_context:
                # jsonb's binary format again; a NULL, non-object or undecodable meta (jsonb
                # nests deeper than orjson reads) reads as {}: the job runs all the same.
                meta = None
                if not PQgetisnull(rows, i, _COL_META):
                    raw = PQgetvalue(rows, i, _COL_META)
                    try:
                        meta = _loads(PyBytes_FromStringAndSize(raw + 1, PQgetlength(rows, i, _COL_META) - 1))
                    except _JSONDecodeError:
                        meta = None
                claimed = (meta if type(meta) is dict else {}, _int8(PQgetvalue(rows, i, _COL_CREATED_AT)),
                           _int8(PQgetvalue(rows, i, _COL_RUN_AT)))
            if not self._last_fast or self._pooled:
                if fast:
                    # May not hold the transaction open: see the reference.
                    self.planner.demote(self._batch_base // self._stride)
                    failures.append(_release(job_id, attempt))
                    continue
                slow.append((spec, job_id, args, attempt, max_attempts, claimed))
                if not PQgetisnull(rows, i, _COL_KEEP_RESULT):  # keep_result: see the reference
                    self._executor.keeping.add(job_id)
                continue
            if self._cancelled and job_id in self._cancelled:
                self._cancelled.discard(job_id)
                failures.append(self._tally(row, _cancelled(job_id, attempt)))
                continue
            context.id = job_id
            context.kind = self._last_kind_str
            context.attempt = attempt
            context.cancelled = False
            if claimed is not None:
                context.queue = self._queue_name
                context.args = args
                context.max_attempts = max_attempts
                context.meta = claimed[0]
                context._enqueued = claimed[1]
                context._scheduled = claimed[2]
                context._started = _wallclock()
            began = _monotonic_ns()  # one clock read: the run's histogram and the guard's bound
            self._at = i
            self._job_began = began * 1e-9
            try:
                # The dict is ours (fresh from orjson): pass it as the kwargs
                # as is, where func(**args) would copy it.
                result = PyObject_Call(self._last_func, _NO_ARGS, args)
            except Exception as exc:
                self._job_began = 0.0
                if self._handing:
                    self._join()
                if row != NULL:
                    _observe(row + _RUN_SUM, _monotonic_ns() - began)
                failures.append(self._tally(
                    row, self._executor.raised(spec, job_id, attempt, max_attempts, exc)))
                if self._handed:
                    break
                continue
            except BaseException as exc:
                self._job_began = 0.0
                if self._handing:
                    self._join()
                if row != NULL:
                    _observe(row + _RUN_SUM, _monotonic_ns() - began)
                failures.append(self._tally(
                    row, self._executor.raised(spec, job_id, attempt, max_attempts, exc)))
                if not self._handed:
                    for j in range(i + 1, n):
                        failures.append(_release(_int8(PQgetvalue(rows, j, _COL_ID)),
                                                 _int2(PQgetvalue(rows, j, _COL_ATTEMPT))))
                    for job in slow:
                        failures.append(_release(job[1], job[3]))
                self.stopping = True
                self.finish()
                raise
            self._job_began = 0.0
            if self._handing:
                self._join()
            if row != NULL:
                _observe(row + _RUN_SUM, _monotonic_ns() - began)
            if (not context.cancelled and (result is None or not _iscoroutine(result))
                    and PQgetisnull(rows, i, _COL_KEEP_RESULT)):
                # This loop's only shortcut (executor.Executor.returned is the
                # rule): a plain return, not cancelled, of a job that keeps no
                # result (keep_result NULL) completes the job inline, so a
                # successful job costs no Python call beyond its handler.
                context.id = 0
                if row != NULL:
                    row[_COMPLETED] += 1
                self._add_done(job_id, attempt)
            else:
                outcome = self._executor.returned(spec, job_id, attempt, max_attempts, result)
                if outcome is None and not PQgetisnull(rows, i, _COL_KEEP_RESULT):
                    outcome = _kept(spec, job_id, attempt, max_attempts, result)
                if outcome is None:
                    if row != NULL:
                        row[_COMPLETED] += 1
                    self._add_done(job_id, attempt)
                else:
                    failures.append(self._tally(row, outcome))
            if self._handed:
                # The guard handed back the jobs behind this one: see the reference.
                break
        # No fast job runs from here on: see the reference.
        if self._running != NULL:
            self._running[_RUNNING_JOB] = 0
        if slow:
            done = []
            first = len(failures)
            self._at = -1
            self._job_began = _monotonic()
            try:
                self._executor.run(slow, done, failures)
            except BaseException:
                # Every slow job is recorded by now: write it all, then stop.
                self._job_began = 0.0
                if self._handing:
                    self._join()
                self._attempts_of(slow, done, failures, first)
                self.stopping = True
                self.finish()
                raise
            self._job_began = 0.0
            if self._handing:
                self._join()
            self._attempts_of(slow, done, failures, first)
        if self._guard_error is not None:
            error, self._guard_error = self._guard_error, None
            raise error
        return 0

    cdef int _join(self) except -1:
        """Wait for the guard's hand-back under way (see the reference's _returned)."""
        try:
            self._guard_lock.acquire()
        except BaseException:
            self._guard_lock.acquire()
            self._guard_lock.release()
            raise
        self._guard_lock.release()
        return 0

    def hand_back(self):
        """From the guard's thread: hand back what a slow handler's batch holds (see the reference)."""
        if self._job_began == 0.0 or self._handed:
            return False
        self._guard_lock.acquire()
        try:
            if self._job_began == 0.0 or self._handed:
                return False
            self._handing = True  # with the check above, before any call: see _guard_lock
            if _monotonic() <= self.due() or not (self._tx or self._holding()):
                return False
            self._handed = True
            self.planner.handed_back(self._batch_base // self._stride)
            try:
                if self._tx:
                    self._hand_over()
                else:
                    self._hand_back_state()
            except LoopError as exc:
                self._guard_error = exc
            return True
        finally:
            self._handing = False
            self._guard_lock.release()

    cdef bint _holding(self):
        """Whether the state-lane batch running holds anything a hand-back would give or write."""
        if self._in_flight or self._at < 0:
            return True
        return (self._at + 1 < self._batch_n or len(self._slow) > 0 or self._ndone > 0
                or len(self._failures) > 0)

    cdef int _hand_over(self) except -1:
        """The fast lane's hand-back (see the reference)."""
        cdef char id_text[24]
        cdef char attempt_text[8]
        cdef const char *values[3]
        cdef list error = []
        cdef PGresult *res
        cdef Py_ssize_t lost
        snprintf(id_text, sizeof(id_text), "%lld",
                 <long long>_int8(PQgetvalue(self._batch, self._at, _COL_ID)))
        snprintf(attempt_text, sizeof(attempt_text), "%d",
                 <int>_int2(PQgetvalue(self._batch, self._at, _COL_ATTEMPT)))
        values[0] = id_text
        values[1] = PyBytes_AS_STRING(self._worker_id)
        values[2] = attempt_text
        if not PQsendQueryPrepared(self._pgconn, b"job_hand_over", 3, values, NULL, NULL, 1):
            raise LoopError(_conn_error(self._pgconn))
        self._flush()
        res = self._results(error)
        if res != NULL:
            PQclear(res)
        self.planner.demote(self._batch_base // self._stride)
        if error:
            lost = self._ndone + len(self._failures)
            self._ndone = 0
            del self._failures[:]
            self._tx = False
            self._simple(b"ROLLBACK")
            _say_rolled_back(lost, error[0])
            return 0
        self._commit(True)
        return 0

    cdef int _hand_back_state(self) except -1:
        """The state lane's hand-back (see the reference)."""
        cdef list releases = []
        cdef list done = []
        cdef list failures = []
        cdef int i
        if self._in_flight:
            self._receive()
            for i in range(self._nrows):
                releases.append(_release(_int8(PQgetvalue(self._rows, i, _COL_ID)),
                                         _int2(PQgetvalue(self._rows, i, _COL_ATTEMPT))))
            if self._rows != NULL:
                PQclear(self._rows)
                self._rows = NULL
            self._nrows = 0
            self.planner.unmark(self.planner.index)
        if self._at >= 0:
            for i in range(self._at + 1, self._batch_n):
                releases.append(_release(_int8(PQgetvalue(self._batch, i, _COL_ID)),
                                         _int2(PQgetvalue(self._batch, i, _COL_ATTEMPT))))
            for job in self._slow:
                releases.append(_release(job[1], job[3]))
            del self._slow[:]
            done = [self._done[i] for i in range(self._ndone)]
            self._ndone = 0
            failures = self._failures[:]
            del self._failures[:]
            self.completed += len(done)
            completed, failed, retried, discarded = _tally(failures)
            self.completed += completed
            self.failed += failed
            self.retried += retried
            self.discarded += discarded
            self.planner.unmark(self._batch_base // self._stride)
        else:
            for job in self._executor.hand_back():
                releases.append(_release(job[1], job[3]))
        failures.extend(releases)
        if not done and not failures:
            return 0
        self._writing(failures)
        error = self._write(done, failures)
        if error is not None:
            _isolate(self._write, done, failures, error)
        self._written()
        return 0

    cdef object _tally(self, long long *row, object outcome):
        """Count `outcome` in the (queue, kind) row `row` (NULL: no counts kept); the outcome."""
        cdef Py_ssize_t column
        if row != NULL:
            column = _outcome_column(outcome)
            if column >= 0:
                row[column] += 1
        return outcome

    cdef int _attempts_of(self, list slow, list done, list failures, Py_ssize_t first) except -1:
        """Take the executor's completions with their attempts, and fill in those its releases lack."""
        cdef dict attempts
        if self._counts != NULL:
            running = self._executor.running
            _count_slow(self._counts_obj, self._batch_base, self._slow_rows, self._other, slow, done,
                        failures[first:], running.took if running is not None else {})
        attempts = {job[1]: job[3] for job in slow}
        for job_id in done:
            self._add_done(job_id, attempts[job_id])
        for outcome in failures[first:]:
            if not outcome["attempt"]:
                outcome["attempt"] = attempts.get(outcome["id"], 0)
        return 0
