# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled twin of the stored-record decoder in :mod:`rmq_async.protocol.message`.

Same inputs, same :class:`MessageExt` results (properties and the offset message id left raw,
as the pure decoder leaves them), the same :class:`ProtocolError` messages in the same order of
checks. :mod:`rmq_async.protocol.message` chooses between the two and calls :func:`install`
before first use.

Messages are created without running ``MessageExt.__init__``: the object is allocated and its
slots are filled directly. They are not tracked by the cycle collector: a decoded message refers
only to strings, bytes, integers and dicts of strings, so it cannot be part of a reference cycle
(CPython leaves tuples and dicts of such values untracked for the same reason), and a consumer
holding many thousands of them does not make every full collection walk them all. The slot
offsets are read from the class's member descriptors when this module is imported, and the
import fails (so the pure decoder is used) if the class does not have the expected layout.

The module also reads the plain JSON command headers brokers write (``json_header``, used by
:mod:`rmq_async.protocol.command`) and turns stored records straight into the buffers of the
sink's Arrow columns (``message_columns``, ``scan_records``, ``record_columns``).
"""

from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport (
    PyBytes_AS_STRING,
    PyBytes_CheckExact,
    PyBytes_FromStringAndSize,
    PyBytes_GET_SIZE,
)
from cpython.dict cimport PyDict_Copy, PyDict_Update
from cpython.list cimport PyList_Append, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_AsLongLong
from cpython.pyport cimport PY_SSIZE_T_MAX
from cpython.ref cimport PyObject, Py_INCREF, Py_XDECREF
from cpython.unicode cimport (
    PyUnicode_DATA,
    PyUnicode_DecodeUTF8,
    PyUnicode_GET_LENGTH,
    PyUnicode_KIND,
    PyUnicode_READ,
    PyUnicode_Substring,
)
from libc.stdint cimport int16_t, int32_t, int64_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset

from types import MemberDescriptorType

cdef extern from *:
    """
    #ifndef RMQ_ASYNC_PYX_DIGEST
    #define RMQ_ASYNC_PYX_DIGEST ""
    #endif
    """
    const char *RMQ_ASYNC_PYX_DIGEST

#: The digest of the ``.pyx`` this module was built from (``setup.py``), empty when built
#: without it; :mod:`rmq_async.protocol.message` does not use a module built from another source.
SOURCE_DIGEST = (<bytes> RMQ_ASYNC_PYX_DIGEST).decode("ascii")

from .errors import ProtocolError
from .types import MessageExt


cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
        int flags
    ctypedef struct PyMemberDescrObject:
        PyMemberDef *d_member
    object PyType_GenericAlloc(type t, Py_ssize_t nitems)
    void PyObject_GC_UnTrack(void *op)
    const char *PyUnicode_AsUTF8AndSize(object text, Py_ssize_t *size) except NULL
    bint PyUnicode_CheckExact(object o)
    bint PyLong_CheckExact(object o)


cdef enum:
    MAGIC_V1 = -626843481
    MAGIC_V2 = -626843477
    BORNHOST_V6 = 0x10
    STOREHOST_V6 = 0x20
    COMPRESSED = 0x1
    UNWRAP_BOTH = 0xC0  # MSG_INNER_BATCH_FLAG | MSG_NEED_UNWRAP_FLAG
    MIN_RECORD = 91
    HEAD_SIZE = 48
    TAIL_SIZE = 16
    BATCH_HEAD_SIZE = 20
    MIN_BATCH_RECORD = 22
    MEMBER_OBJECT_EX = 16  # T_OBJECT_EX
    MEMBER_READONLY = 1  # READONLY

# ---------------------------------------------------------------------------------------------
# MessageExt slots

cdef enum:
    S_TOPIC = 0
    S_BODY = 1
    S_QUEUE_ID = 2
    S_QUEUE_OFFSET = 3
    S_FLAG = 4
    S_SYS_FLAG = 5
    S_STORE_SIZE = 6
    S_BODY_CRC = 7
    S_COMMIT_LOG_OFFSET = 8
    S_BORN_TIMESTAMP = 9
    S_BORN_HOST = 10
    S_STORE_TIMESTAMP = 11
    S_STORE_HOST = 12
    S_RECONSUME_TIMES = 13
    S_PREPARED = 14
    S_BROKER_NAME = 15
    S_PROPS = 16
    S_PROPS_RAW = 17
    S_PROPS_PENDING = 18
    S_OID = 19
    S_OID_HOST = 20
    S_OID_OFFSET = 21
    N_SLOTS = 22


_SLOT_NAMES = (
    "topic", "body", "queue_id", "queue_offset", "flag", "sys_flag", "store_size", "body_crc",
    "commit_log_offset", "born_timestamp", "born_host", "store_timestamp", "store_host",
    "reconsume_times", "prepared_transaction_offset", "broker_name",
    "_props", "_props_raw", "_props_pending", "_oid", "_oid_host", "_oid_offset",
)

cdef Py_ssize_t _slot_offset[N_SLOTS]
cdef type _message_type = MessageExt


cdef _read_layout():
    cdef PyMemberDescrObject *d
    if MessageExt.__new__ is not object.__new__:
        raise ImportError("MessageExt has its own __new__")
    for i, name in enumerate(_SLOT_NAMES):
        desc = None
        for klass in MessageExt.__mro__:
            desc = klass.__dict__.get(name)
            if desc is not None:
                break
        if type(desc) is not MemberDescriptorType:
            raise ImportError(f"MessageExt.{name} is not a slot")
        d = <PyMemberDescrObject *> desc
        if d.d_member.type != MEMBER_OBJECT_EX or d.d_member.flags & MEMBER_READONLY:
            raise ImportError(f"MessageExt.{name} is not a plain object slot")
        _slot_offset[i] = d.d_member.offset


_read_layout()


cdef inline void _put(object obj, int slot, object value):
    cdef PyObject **field = <PyObject **> ((<char *> <PyObject *> obj) + _slot_offset[slot])
    Py_INCREF(value)
    Py_XDECREF(field[0])
    field[0] = <PyObject *> value


cdef inline object _get(object obj, int slot):
    cdef PyObject *value = (<PyObject **> ((<char *> <PyObject *> obj) + _slot_offset[slot]))[0]
    if value == NULL:
        return None
    return <object> value


# ---------------------------------------------------------------------------------------------
# Helpers installed by rmq_async.protocol.message

cdef object _decompress = None  # (body, sys_flag, limit) -> bytes
cdef object _host6 = None  # (address bytes, port) -> (text, hex)


def install(decompress, host6):
    """Give the decoder the pure module's decompression and IPv6 host formatting."""
    global _decompress, _host6
    _decompress = decompress
    _host6 = host6


# ---------------------------------------------------------------------------------------------
# Reading big-endian integers

cdef inline uint32_t _u32(const unsigned char *p) noexcept nogil:
    return ((<uint32_t> p[0]) << 24) | ((<uint32_t> p[1]) << 16) | ((<uint32_t> p[2]) << 8) | p[3]


cdef inline int32_t _i32(const unsigned char *p) noexcept nogil:
    return <int32_t> _u32(p)


cdef inline int16_t _i16(const unsigned char *p) noexcept nogil:
    return <int16_t> (((<uint32_t> p[0]) << 8) | p[1])


cdef inline int64_t _i64(const unsigned char *p) noexcept nogil:
    return <int64_t> (((<uint64_t> _u32(p)) << 32) | _u32(p + 4))


# ---------------------------------------------------------------------------------------------
# Hosts: "ip:port" text and the upper-case hex that starts the offset message id

cdef dict _host4_cache = {}
cdef enum:
    HOST_CACHE_MAX = 4096
# The last IPv4 host seen in each role (0: born, 1: store): consecutive records mostly repeat it.
cdef uint64_t _born_key = 0, _store_key = 0
cdef tuple _born_info = None, _store_info = None


cdef tuple _host4_lookup(uint64_t key, uint32_t ip, int32_t port):
    cdef char text[32]
    cdef char hexa[20]
    info = _host4_cache.get(key)
    if info is None:
        snprintf(text, sizeof(text), b"%u.%u.%u.%u:%d", ip >> 24, (ip >> 16) & 0xFF,
                 (ip >> 8) & 0xFF, ip & 0xFF, port)
        snprintf(hexa, sizeof(hexa), b"%08X%08X", ip, <uint32_t> port)
        info = (text.decode("ascii"), hexa.decode("ascii"))
        if len(_host4_cache) >= HOST_CACHE_MAX:
            _host4_cache.clear()
        _host4_cache[key] = info
    return <tuple> info


cdef inline tuple _host4(uint32_t ip, int32_t port, int role):
    global _born_key, _store_key, _born_info, _store_info
    cdef uint64_t key = ((<uint64_t> ip) << 32) | <uint32_t> port
    if role == 0:
        if _born_info is None or _born_key != key:
            _born_info = _host4_lookup(key, ip, port)
            _born_key = key
        return _born_info
    if _store_info is None or _store_key != key:
        _store_info = _host4_lookup(key, ip, port)
        _store_key = key
    return _store_info


# ---------------------------------------------------------------------------------------------
# Properties

cdef dict _parse_text(str text):
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef int kind = PyUnicode_KIND(text)
    cdef void *data = PyUnicode_DATA(text)
    cdef Py_ssize_t i, start = 0, sep = -1
    cdef Py_UCS4 ch
    cdef dict out = {}
    for i in range(n + 1):
        if i < n:
            ch = PyUnicode_READ(kind, data, i)
            if ch == 1:
                if sep < 0:
                    sep = i
                continue
            if ch != 2:
                continue
        # One segment: [start, i), name before the first \x01, value after it.
        if sep > start and i > sep + 1:
            out[PyUnicode_Substring(text, start, sep)] = PyUnicode_Substring(text, sep + 1, i)
        start = i + 1
        sep = -1
    return out


cdef object _find_in_text(str text, str name):
    # The value parse would give ``name`` (the last pair with that name and a non-empty value),
    # or None; no dict and no substring other than the result are built.
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef Py_ssize_t name_len = PyUnicode_GET_LENGTH(name)
    cdef int kind = PyUnicode_KIND(text)
    cdef void *data = PyUnicode_DATA(text)
    cdef int name_kind = PyUnicode_KIND(name)
    cdef void *name_data = PyUnicode_DATA(name)
    cdef Py_ssize_t i, j, start = 0, sep = -1, found_start = -1, found_end = -1
    cdef Py_UCS4 ch
    cdef bint same
    if name_len == 0:
        return None
    for i in range(n + 1):
        if i < n:
            ch = PyUnicode_READ(kind, data, i)
            if ch == 1:
                if sep < 0:
                    sep = i
                continue
            if ch != 2:
                continue
        if sep - start == name_len and i > sep + 1:
            if kind == name_kind:
                same = memcmp(<char *> data + start * kind, name_data, name_len * kind) == 0
            else:
                same = True
                for j in range(name_len):
                    if PyUnicode_READ(kind, data, start + j) != \
                            PyUnicode_READ(name_kind, name_data, j):
                        same = False
                        break
            if same:
                found_start = sep + 1
                found_end = i
        start = i + 1
        sep = -1
    if found_start < 0:
        return None
    return PyUnicode_Substring(text, found_start, found_end)


def find_raw_property(bytes raw not None, str name not None):
    """``parse_raw_properties(raw).get(name)`` without building the dict."""
    return _find_in_text(PyUnicode_DecodeUTF8(PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw),
                                              b"replace"), name)


def decode_properties(object text):
    """Compiled :func:`rmq_async.protocol.message.decode_properties` (a ``str`` subclass is
    read as its text, as the pure function's ``split`` reads it)."""
    return _parse_text(_exact_str(text))


cdef str _exact_str(object text):
    if type(text) is str:
        return <str> text
    if isinstance(text, str):
        return str.__str__(text)  # the text itself, as an exact str
    raise TypeError(f"expected str, got {type(text).__name__}")


def parse_raw_properties(bytes raw not None):
    """Stored properties bytes (UTF-8, undecodable bytes replaced) to a dict."""
    return _parse_text(PyUnicode_DecodeUTF8(PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw),
                                            b"replace"))


# ---------------------------------------------------------------------------------------------
# Records

cdef bytes _last_topic_raw = b""
cdef str _last_topic = ""


cdef str _topic(const unsigned char *p, Py_ssize_t length):
    global _last_topic_raw, _last_topic
    if length == PyBytes_GET_SIZE(_last_topic_raw) and \
            memcmp(p, PyBytes_AS_STRING(_last_topic_raw), length) == 0:
        return _last_topic
    try:
        topic = PyUnicode_DecodeUTF8(<const char *> p, length, NULL)
    except UnicodeDecodeError:
        raise ProtocolError("topic is not valid UTF-8") from None
    _last_topic_raw = PyBytes_FromStringAndSize(<const char *> p, length)
    _last_topic = topic
    return topic


cdef _unwrap_batch(object outer, list out):
    cdef bytes data = _get(outer, S_BODY)
    cdef const unsigned char *buf = <const unsigned char *> PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
    cdef Py_ssize_t pos = 0, end, p
    cdef int32_t total, flag, body_len
    cdef int16_t props_len
    index = 0
    outer_offset = _get(outer, S_QUEUE_OFFSET)
    while pos < n:
        if n - pos < MIN_BATCH_RECORD:
            raise ProtocolError("truncated inner batch record")
        total = _i32(buf + pos)
        flag = _i32(buf + pos + 12)
        body_len = _i32(buf + pos + 16)
        end = pos + total
        if total < MIN_BATCH_RECORD or end > n:
            raise ProtocolError(f"bad inner batch record size {total}")
        p = pos + BATCH_HEAD_SIZE
        if body_len < 0 or body_len > end - p - 2:
            raise ProtocolError(f"bad inner batch body length {body_len}")
        body = PyBytes_FromStringAndSize(<const char *> buf + p, body_len)
        p += body_len
        props_len = _i16(buf + p)
        p += 2
        if props_len < 0 or p + props_len != end:
            raise ProtocolError(f"bad inner batch properties length {props_len}")
        msg = PyType_GenericAlloc(_message_type, 0)
        _put(msg, S_TOPIC, _get(outer, S_TOPIC))
        _put(msg, S_BODY, body)
        _put(msg, S_QUEUE_ID, _get(outer, S_QUEUE_ID))
        _put(msg, S_QUEUE_OFFSET, outer_offset + index)
        _put(msg, S_FLAG, flag)
        _put(msg, S_SYS_FLAG, _get(outer, S_SYS_FLAG))
        _put(msg, S_PROPS, None)
        _put(msg, S_PROPS_RAW, PyBytes_FromStringAndSize(<const char *> buf + p, props_len))
        _put(msg, S_PROPS_PENDING, None)
        _put(msg, S_STORE_SIZE, 0)
        _put(msg, S_BODY_CRC, 0)
        _put(msg, S_COMMIT_LOG_OFFSET, _get(outer, S_COMMIT_LOG_OFFSET))
        _put(msg, S_BORN_TIMESTAMP, _get(outer, S_BORN_TIMESTAMP))
        _put(msg, S_BORN_HOST, _get(outer, S_BORN_HOST))
        _put(msg, S_STORE_TIMESTAMP, _get(outer, S_STORE_TIMESTAMP))
        _put(msg, S_STORE_HOST, _get(outer, S_STORE_HOST))
        _put(msg, S_RECONSUME_TIMES, 0)
        _put(msg, S_PREPARED, 0)
        _put(msg, S_OID, _get(outer, S_OID))
        _put(msg, S_OID_HOST, _get(outer, S_OID_HOST))
        _put(msg, S_OID_OFFSET, _get(outer, S_OID_OFFSET))
        _put(msg, S_BROKER_NAME, _get(outer, S_BROKER_NAME))
        PyObject_GC_UnTrack(<void *> msg)
        PyList_Append(out, msg)
        pos = end
        index += 1


def stamp_delivered(list msgs not None, object broker_name, dict values not None):
    """Compiled ``_stamp_delivered``: the same, writing the slots directly."""
    cdef Py_ssize_t i = 0
    cdef object msg
    while i < PyList_GET_SIZE(msgs):  # read each time: other types run code of their own
        msg = <object> PyList_GET_ITEM(msgs, i)
        if type(msg) is _message_type:
            _put(msg, S_BROKER_NAME, broker_name)
        else:
            msg.broker_name = broker_name
        i += 1
    _put_each(msgs, values)


def put_each(list msgs not None, dict values not None):
    """Compiled ``_put_each``: the same, writing the slots directly."""
    _put_each(msgs, values)


cdef _put_each(list msgs, dict values):
    # One dict for all messages with nothing pending (a pulled chunk) and one for each run of
    # messages that shared a pending dict, not a copy per message (each one an allocation
    # that also counts towards the next garbage collection). Pending dicts may be shared, so
    # they are replaced, never changed in place.
    cdef Py_ssize_t i = -1
    cdef object msg, props, pending, merged
    cdef object fresh = None, last_old = None, last_new = None
    while True:
        i += 1
        if i >= PyList_GET_SIZE(msgs):  # read each time: other types run code of their own
            break
        msg = <object> PyList_GET_ITEM(msgs, i)
        if type(msg) is not _message_type:
            msg.put_properties(values)
            continue
        props = _get(msg, S_PROPS)
        if props is not None:
            if type(props) is dict:
                PyDict_Update(props, values)
            else:  # a mapping the user set: its own update, as the pure twin calls it
                props.update(values)
            continue
        pending = _get(msg, S_PROPS_PENDING)
        if pending is None:
            if fresh is None:
                fresh = PyDict_Copy(values)
            _put(msg, S_PROPS_PENDING, fresh)
            continue
        if pending is not last_old:
            last_old = pending
            last_new = PyDict_Copy(pending)
            PyDict_Update(last_new, values)
        _put(msg, S_PROPS_PENDING, last_new)


cdef inline object _slot_or_attr(object msg, int slot, str name):
    """A slot of a MessageExt read directly; any other object's attribute (or an unset slot's
    AttributeError) the usual way."""
    cdef object value
    if type(msg) is _message_type:
        value = _get(msg, slot)
        if value is not None:
            return value
    return getattr(msg, name)


def cache_run(list msgs not None, dict cache not None, dict taken not None, object last):
    """Compiled ``_cache_run``: the same, reading the slots directly."""
    cdef Py_ssize_t i = 0, size = 0
    cdef list added = []
    cdef object msg, offset
    while i < PyList_GET_SIZE(msgs):  # read each time: other types run code of their own
        msg = <object> PyList_GET_ITEM(msgs, i)
        offset = _slot_or_attr(msg, S_QUEUE_OFFSET, "queue_offset")
        if offset in cache or (taken and offset in taken):
            i += 1
            continue
        if offset <= last:
            break
        cache[offset] = msg
        PyList_Append(added, offset)
        size += len(_slot_or_attr(msg, S_BODY, "body"))
        last = offset
        i += 1
    return i, added, size


def uncache(list msgs not None, dict cache not None, type keep not None):
    """Compiled ``_uncache``: the same, reading the slots directly."""
    cdef Py_ssize_t i = 0, removed = 0, size = 0
    cdef object msg, offset, cached
    while i < PyList_GET_SIZE(msgs):  # read each time: other types run code of their own
        msg = <object> PyList_GET_ITEM(msgs, i)
        i += 1
        offset = _slot_or_attr(msg, S_QUEUE_OFFSET, "queue_offset")
        cached = cache.get(offset)
        if cached is not None and not isinstance(cached, keep):
            del cache[offset]
            removed += 1
            size += len(_slot_or_attr(cached, S_BODY, "body"))
    return removed, size


def decode_records(bytes data not None, list out not None, bint decompress, bint unwrap_batch,
                   max_body_size, Py_ssize_t limit):
    """Compiled ``_decode_records``: append the messages of ``data`` to ``out``."""
    cdef const unsigned char *buf = <const unsigned char *> PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
    cdef Py_ssize_t pos = 0, remaining, end, p
    cdef int32_t total, magic, sys_flag, body_len, topic_len
    cdef int64_t store_ts
    cdef int topic_len_size
    cdef int16_t props_len
    cdef tuple born, store
    while pos < n and PyList_GET_SIZE(out) < limit:
        remaining = n - pos
        if remaining < MIN_RECORD:
            raise ProtocolError(f"truncated message record: {remaining} bytes left")
        total = _i32(buf + pos)
        magic = _i32(buf + pos + 4)
        end = pos + total
        if total < MIN_RECORD or total > remaining:
            raise ProtocolError(f"bad message record size {total} ({remaining} bytes left)")
        if magic != MAGIC_V1 and magic != MAGIC_V2:
            raise ProtocolError(f"bad message magic code {(<object> magic) & 0xFFFFFFFF:#010x}")
        sys_flag = _i32(buf + pos + 36)
        if sys_flag & (BORNHOST_V6 | STOREHOST_V6):
            # At least one IPv6 host: the fixed part has a different layout.
            p = pos + HEAD_SIZE
            if sys_flag & BORNHOST_V6:
                if end - p < 20:
                    raise ProtocolError("truncated born host")
                born = _host6(PyBytes_FromStringAndSize(<const char *> buf + p, 16),
                              _i32(buf + p + 16))
                p += 20
            else:
                born = _host4(_u32(buf + p), _i32(buf + p + 4), 0)
                p += 8
            if end - p < 8:
                raise ProtocolError("truncated store timestamp")
            store_ts = _i64(buf + p)
            p += 8
            if sys_flag & STOREHOST_V6:
                if end - p < 20:
                    raise ProtocolError("truncated store host")
                store = _host6(PyBytes_FromStringAndSize(<const char *> buf + p, 16),
                               _i32(buf + p + 16))
                p += 20
            else:
                if end - p < 8:
                    raise ProtocolError("truncated store host")
                store = _host4(_u32(buf + p), _i32(buf + p + 4), 1)
                p += 8
            if end - p < TAIL_SIZE:
                raise ProtocolError("truncated message record")
        else:
            born = _host4(_u32(buf + pos + 48), _i32(buf + pos + 52), 0)
            store_ts = _i64(buf + pos + 56)
            store = _host4(_u32(buf + pos + 64), _i32(buf + pos + 68), 1)
            p = pos + 72
        # p: reconsumeTimes, preparedTransactionOffset, bodyLength
        reconsume = _i32(buf + p)
        prepared = _i64(buf + p + 4)
        body_len = _i32(buf + p + 12)
        p += TAIL_SIZE
        topic_len_size = 1 if magic == MAGIC_V1 else 2
        if body_len < 0 or body_len > end - p - topic_len_size - 2:
            raise ProtocolError(f"bad message body length {body_len}")
        body = PyBytes_FromStringAndSize(<const char *> buf + p, body_len)
        p += body_len
        if topic_len_size == 1:
            topic_len = buf[p]
            if topic_len > 127:
                raise ProtocolError("negative topic length")
            p += 1
        else:
            topic_len = _i16(buf + p)
            if topic_len < 0:
                raise ProtocolError("negative topic length")
            p += 2
        if topic_len > end - p - 2:
            raise ProtocolError(f"bad topic length {topic_len}")
        topic = _topic(buf + p, topic_len)
        p += topic_len
        props_len = _i16(buf + p)
        p += 2
        if props_len < 0 or p + props_len != end:
            raise ProtocolError(
                f"bad properties length {props_len} (record has {end - p} bytes left)"
            )
        if decompress and sys_flag & COMPRESSED and body:
            # Java inflates (and clears the flag of) a non-empty body only: an empty one is
            # stored as is, its flag kept.
            body = _decompress(body, sys_flag, max_body_size)
            sys_flag &= ~COMPRESSED
        commit_offset = _i64(buf + pos + 28)
        msg = PyType_GenericAlloc(_message_type, 0)
        _put(msg, S_TOPIC, topic)
        _put(msg, S_BODY, body)
        _put(msg, S_QUEUE_ID, _i32(buf + pos + 12))
        _put(msg, S_QUEUE_OFFSET, _i64(buf + pos + 20))
        _put(msg, S_FLAG, _i32(buf + pos + 16))
        _put(msg, S_SYS_FLAG, sys_flag)
        _put(msg, S_PROPS, None)
        _put(msg, S_PROPS_RAW, PyBytes_FromStringAndSize(<const char *> buf + p, props_len))
        _put(msg, S_PROPS_PENDING, None)
        _put(msg, S_STORE_SIZE, total)
        _put(msg, S_BODY_CRC, _i32(buf + pos + 8))
        _put(msg, S_COMMIT_LOG_OFFSET, commit_offset)
        _put(msg, S_BORN_TIMESTAMP, _i64(buf + pos + 40))
        _put(msg, S_BORN_HOST, born[0])
        _put(msg, S_STORE_TIMESTAMP, store_ts)
        _put(msg, S_STORE_HOST, store[0])
        _put(msg, S_RECONSUME_TIMES, reconsume)
        _put(msg, S_PREPARED, prepared)
        _put(msg, S_OID, None)
        _put(msg, S_OID_HOST, store[1])
        _put(msg, S_OID_OFFSET, commit_offset)
        _put(msg, S_BROKER_NAME, "")
        PyObject_GC_UnTrack(<void *> msg)
        if unwrap_batch and (sys_flag & UNWRAP_BOTH) == UNWRAP_BOTH:
            _unwrap_batch(msg, out)
        else:
            PyList_Append(out, msg)
        pos = end


# ---------------------------------------------------------------------------------------------
# Columns: a list of messages to the buffers of the sink's Arrow columns
#
# Three passes over the rows. (1) With the GIL, read the slots of every message into a C row
# (pointers into the message's own bytes and str objects, which ``refs`` keeps alive). (2)
# Without the GIL, split each raw properties record into (name, value) entries by the rules of
# ``_parse_text``; a record whose dict would differ from a plain list of its pairs (a repeated
# name, bytes that are not UTF-8, many pairs) is marked, and (3) with the GIL, takes its pairs
# from ``msg.properties``, the Python parse. Then, without the GIL, every output size is
# measured, the buffers are allocated (with the GIL, uninitialised) and filled.

cdef struct Span:
    const char *p
    Py_ssize_t n


cdef struct Entry:
    Span name
    Span value


cdef struct Row:
    Span topic
    Span broker
    Span born_host
    Span store_host
    Span body
    Span props
    Span oid  # the whole offset message id, or (oid_host) its host part
    int64_t queue_offset
    int64_t born_ts
    int64_t store_ts
    int64_t oid_offset
    int32_t queue_id
    int32_t reconsume
    bint oid_host
    int props_state  # PROPS_*
    Py_ssize_t first_entry
    Py_ssize_t n_entries
    Py_ssize_t pend_first  # PROPS_RAW_PENDING: the pending pairs, in the separate pending entries
    Py_ssize_t pend_n
    Py_ssize_t tags  # entry index of TAGS or -1
    Py_ssize_t keys  # entry index of KEYS or -1
    Py_ssize_t uniq  # entry index of UNIQ_KEY or -1


cdef enum:
    PROPS_RAW = 0
    PROPS_FROM_DICT = 1
    PROPS_READY = 2
    PROPS_RAW_PENDING = 3  # raw pairs, then the pending ones applied over them
    MAX_RAW_PAIRS = 64
    OFFSET_HEX = 16
    INT32_LIMIT = 0x7FFFFFFF


cdef struct Entries:
    Entry *items
    Py_ssize_t size
    Py_ssize_t cap


cdef int _entries_push(Entries *e, const char *name, Py_ssize_t name_len, const char *value,
                       Py_ssize_t value_len) noexcept nogil:
    cdef Py_ssize_t cap
    cdef Entry *grown
    if e.size == e.cap:
        cap = e.cap * 2 if e.cap else 1024
        grown = <Entry *> realloc(e.items, cap * sizeof(Entry))
        if grown == NULL:
            return -1
        e.items = grown
        e.cap = cap
    e.items[e.size].name.p = name
    e.items[e.size].name.n = name_len
    e.items[e.size].value.p = value
    e.items[e.size].value.n = value_len
    e.size += 1
    return 0


cdef bint _valid_utf8(const unsigned char *s, Py_ssize_t n) noexcept nogil:
    # The strict rules of Python's UTF-8 codec: no overlong forms, no surrogates, <= U+10FFFF.
    cdef Py_ssize_t i = 0, j, need
    cdef unsigned char c, lo, hi
    while i < n:
        c = s[i]
        if c < 0x80:
            i += 1
            continue
        lo = 0x80
        hi = 0xBF
        if 0xC2 <= c <= 0xDF:
            need = 1
        elif c == 0xE0:
            need = 2
            lo = 0xA0
        elif 0xE1 <= c <= 0xEC or c == 0xEE or c == 0xEF:
            need = 2
        elif c == 0xED:
            need = 2
            hi = 0x9F
        elif c == 0xF0:
            need = 3
            lo = 0x90
        elif 0xF1 <= c <= 0xF3:
            need = 3
        elif c == 0xF4:
            need = 3
            hi = 0x8F
        else:
            return False
        if n - i <= need:
            return False
        if s[i + 1] < lo or s[i + 1] > hi:
            return False
        for j in range(2, need + 1):
            if s[i + j] < 0x80 or s[i + j] > 0xBF:
                return False
        i += need + 1
    return True


cdef bint _span_is(Span s, const char *text, Py_ssize_t n) noexcept nogil:
    return s.n == n and memcmp(s.p, text, n) == 0


cdef int _split_raw(Row *row, Entries *entries) noexcept nogil:
    # The pairs of a raw properties record, as ``_parse_text`` would keep them; 1 when the
    # record must be read through Python instead, -1 when out of memory.
    cdef const unsigned char *s = <const unsigned char *> row.props.p
    cdef Py_ssize_t n = row.props.n, i, j, start = 0, sep = -1
    cdef Py_ssize_t first = entries.size
    cdef bint high = False, repeated
    cdef unsigned char ch
    for i in range(n + 1):
        if i < n:
            ch = s[i]
            if ch == 1:
                if sep < 0:
                    sep = i
                continue
            if ch != 2:
                if ch >= 0x80:
                    high = True
                continue
        if sep > start and i > sep + 1:
            # A repeated name (the broker stores WAIT twice in every message of a batch) keeps
            # its first place and takes the last value, as the dict does; the names compare
            # as bytes, which is the same as comparing them decoded when the record is valid
            # UTF-8 (checked below: an invalid one goes through Python).
            repeated = False
            for j in range(first, entries.size):
                if _span_is(entries.items[j].name, <const char *> s + start, sep - start):
                    entries.items[j].value.p = <const char *> s + sep + 1
                    entries.items[j].value.n = i - sep - 1
                    repeated = True
                    break
            if not repeated:
                if entries.size - first == MAX_RAW_PAIRS:
                    entries.size = first
                    return 1
                if _entries_push(entries, <const char *> s + start, sep - start,
                                 <const char *> s + sep + 1, i - sep - 1) < 0:
                    return -1
        start = i + 1
        sep = -1
    if high and not _valid_utf8(s, n):
        entries.size = first
        return 1
    row.first_entry = first
    row.n_entries = entries.size - first
    return 0


cdef inline Span _utf8(object text) except *:
    cdef Span span
    span.p = PyUnicode_AsUTF8AndSize(text, &span.n)
    return span


cdef inline int64_t _int(object value) except? -1:
    if not PyLong_CheckExact(value):
        raise TypeError("not an int")
    return PyLong_AsLongLong(value)


cdef inline int32_t _int32(object value) except? -1:
    cdef int64_t v = _int(value)
    if v < -2147483648 or v > 2147483647:
        raise OverflowError("out of int32 range")
    return <int32_t> v


cdef int _read_row(object msg, Row *row, list refs) except -1:
    # Fills ``row`` from the slots of ``msg``; raises when a value has an unexpected type.
    if type(msg) is not _message_type:
        raise TypeError("not a MessageExt")
    topic = _get(msg, S_TOPIC)
    broker = _get(msg, S_BROKER_NAME)
    born_host = _get(msg, S_BORN_HOST)
    store_host = _get(msg, S_STORE_HOST)
    body = _get(msg, S_BODY)
    if not (PyUnicode_CheckExact(topic) and PyUnicode_CheckExact(broker)
            and PyUnicode_CheckExact(born_host) and PyUnicode_CheckExact(store_host)
            and PyBytes_CheckExact(body)):
        raise TypeError("unexpected field type")
    row.topic = _utf8(topic)
    row.broker = _utf8(broker)
    row.born_host = _utf8(born_host)
    row.store_host = _utf8(store_host)
    row.body.p = PyBytes_AS_STRING(body)
    row.body.n = PyBytes_GET_SIZE(body)
    row.queue_id = _int32(_get(msg, S_QUEUE_ID))
    row.queue_offset = _int(_get(msg, S_QUEUE_OFFSET))
    row.born_ts = _int(_get(msg, S_BORN_TIMESTAMP))
    row.store_ts = _int(_get(msg, S_STORE_TIMESTAMP))
    row.reconsume = _int32(_get(msg, S_RECONSUME_TIMES))
    oid = _get(msg, S_OID)
    if oid is not None:
        if not PyUnicode_CheckExact(oid):
            raise TypeError("offset_msg_id is not a str")
        row.oid = _utf8(oid)
        row.oid_host = False
    else:
        oid = _get(msg, S_OID_HOST)
        if not PyUnicode_CheckExact(oid):
            raise TypeError("no offset_msg_id")
        row.oid = _utf8(oid)
        row.oid_offset = _int(_get(msg, S_OID_OFFSET))
        row.oid_host = True
    raw = _get(msg, S_PROPS_RAW)
    pending = _get(msg, S_PROPS_PENDING)
    if _get(msg, S_PROPS) is None and PyBytes_CheckExact(raw) and \
            (pending is None or type(pending) is dict):
        row.props.p = PyBytes_AS_STRING(raw)
        row.props.n = PyBytes_GET_SIZE(raw)
        row.props_state = PROPS_RAW if pending is None else PROPS_RAW_PENDING
        refs.append(raw)
    else:
        row.props_state = PROPS_FROM_DICT
    refs.append(body)
    refs.append(oid)
    refs.append(topic)
    refs.append(broker)
    refs.append(born_host)
    refs.append(store_host)
    return 0


cdef int _str_pair(object name, object value, list refs, Entry *out) except -1:
    # The UTF-8 of one property (both str), kept alive by ``refs``.
    if not (PyUnicode_CheckExact(name) and PyUnicode_CheckExact(value)):
        raise TypeError("a property is not a str")
    out.name = _utf8(name)
    out.value = _utf8(value)
    refs.append(name)
    refs.append(value)
    return 0


cdef int _put_dict(dict props, Row *row, Entries *entries, list refs) except -1:
    # The row's pairs are those of ``props``, appended to the entries. A dict's names are
    # unique, so none is looked up (a record may carry thousands of pairs).
    cdef Entry pair
    row.first_entry = entries.size
    for name, value in props.items():
        _str_pair(name, value, refs, &pair)
        if _entries_push(entries, pair.name.p, pair.name.n, pair.value.p, pair.value.n) < 0:
            raise MemoryError()
    row.n_entries = entries.size - row.first_entry
    row.props_state = PROPS_READY
    return 0


cdef int _pairs_from_dict(object msg, Row *row, Entries *entries, list refs) except -1:
    # The pairs of ``msg.properties``, the Python parse (pending properties included).
    props = msg.properties
    if type(props) is not dict:
        raise TypeError("properties is not a dict")
    return _put_dict(<dict> props, row, entries, refs)


cdef int _pending_entries(dict pending, Entries *pend, list refs, Row *row) except -1:
    # Appends the pairs of ``pending`` (the properties the pull adds) to ``pend`` and points the
    # row at them; the merge over the row's raw pairs then runs without the GIL.
    cdef Entry pair
    row.pend_first = pend.size
    for name, value in pending.items():
        _str_pair(name, value, refs, &pair)
        if _entries_push(pend, pair.name.p, pair.name.n, pair.value.p, pair.value.n) < 0:
            raise MemoryError()
    row.pend_n = pend.size - row.pend_first
    return 0


cdef int _merge_pending(Row *row, Entries *entries, const Entry *pend) noexcept nogil:
    # ``dict.update`` of the row's raw pairs (the last ones pushed) with its pending pairs: a
    # name already there takes the new value in its place, a new name goes last. -1: no memory.
    cdef Py_ssize_t i, j
    cdef bint found
    for j in range(row.pend_first, row.pend_first + row.pend_n):
        found = False
        for i in range(row.first_entry, entries.size):
            if _span_is(entries.items[i].name, pend[j].name.p, pend[j].name.n):
                entries.items[i].value = pend[j].value
                found = True
                break
        if not found and _entries_push(entries, pend[j].name.p, pend[j].name.n, pend[j].value.p,
                                       pend[j].value.n) < 0:
            return -1
    row.n_entries = entries.size - row.first_entry
    return 0


cdef struct Sizes:
    Py_ssize_t topic, broker, msg_id, oid, tags, tags_null, key_tokens, keys, body
    Py_ssize_t prop_names, prop_values, born_host, store_host
    Py_ssize_t entries  # pairs of all rows (rows that took theirs again leave unused ones)


cdef void _find_system(Row *row, const Entry *items) noexcept nogil:
    cdef Py_ssize_t i
    row.tags = row.keys = row.uniq = -1
    for i in range(row.first_entry, row.first_entry + row.n_entries):
        # In both sources a name occurs at most once.
        if _span_is(items[i].name, b"TAGS", 4):
            row.tags = i
        elif _span_is(items[i].name, b"KEYS", 4):
            row.keys = i
        elif _span_is(items[i].name, b"UNIQ_KEY", 8):
            row.uniq = i


cdef inline Py_ssize_t _oid_len(const Row *row) noexcept nogil:
    return row.oid.n + OFFSET_HEX if row.oid_host else row.oid.n


cdef void _measure(Row *rows, Py_ssize_t n, const Entry *items, Sizes *z) noexcept nogil:
    cdef Py_ssize_t r, i, tok
    cdef Span v
    memset(z, 0, sizeof(Sizes))
    for r in range(n):
        _find_system(&rows[r], items)
        z.topic += rows[r].topic.n
        z.broker += rows[r].broker.n
        z.oid += _oid_len(&rows[r])
        if rows[r].uniq >= 0 and items[rows[r].uniq].value.n > 0:
            z.msg_id += items[rows[r].uniq].value.n
        else:
            z.msg_id += _oid_len(&rows[r])
        if rows[r].tags >= 0:
            z.tags += items[rows[r].tags].value.n
        else:
            z.tags_null += 1
        if rows[r].keys >= 0:
            v = items[rows[r].keys].value
            tok = 0
            for i in range(v.n):
                if v.p[i] == 32:
                    tok = 0
                else:
                    z.keys += 1
                    if tok == 0:
                        z.key_tokens += 1
                    tok = 1
        z.body += rows[r].body.n
        z.entries += rows[r].n_entries
        for i in range(rows[r].first_entry, rows[r].first_entry + rows[r].n_entries):
            z.prop_names += items[i].name.n
            z.prop_values += items[i].value.n
        z.born_host += rows[r].born_host.n
        z.store_host += rows[r].store_host.n


cdef inline char *_buf(bytearray b) noexcept:
    return PyByteArray_AS_STRING(b)


cdef char *_hold_writable(object buf, Py_buffer *view, Py_ssize_t size) except NULL:
    # The memory of a writable buffer the caller's allocator returned. The view stays held
    # (the caller releases it once the fill is done), so the buffer can be neither resized
    # nor freed by another thread while the fill writes into it without the GIL.
    PyObject_GetBuffer(buf, view, PyBUF_WRITABLE)
    if view.buf == NULL or view.len < size:
        length = view.len
        PyBuffer_Release(view)
        if length < size:
            raise ValueError(f"the allocator returned {length} bytes for {size}")
        raise MemoryError("the allocator returned a buffer without memory")
    return <char *> view.buf


cdef bytearray _alloc(Py_ssize_t size):
    return PyByteArray_FromStringAndSize(NULL, size)


cdef inline void _put_text(int32_t *offsets, char *data, Py_ssize_t index, int32_t *pos,
                           const char *p, Py_ssize_t n) noexcept nogil:
    memcpy(data + pos[0], p, n)
    pos[0] += <int32_t> n
    offsets[index + 1] = pos[0]


cdef inline void _put_oid(int32_t *offsets, char *data, Py_ssize_t index, int32_t *pos,
                          const Row *row) noexcept nogil:
    cdef const char *digits = b"0123456789ABCDEF"
    cdef uint64_t value
    cdef char *out
    cdef int i
    memcpy(data + pos[0], row.oid.p, row.oid.n)
    pos[0] += <int32_t> row.oid.n
    if row.oid_host:
        value = <uint64_t> row.oid_offset
        out = data + pos[0]
        for i in range(OFFSET_HEX):
            out[OFFSET_HEX - 1 - i] = digits[value & 0xF]
            value >>= 4
        pos[0] += OFFSET_HEX
    offsets[index + 1] = pos[0]


cdef int _split_rows(Row *rows, Py_ssize_t n, Entries *entries,
                     const Entry *pend) noexcept nogil:
    # Split the raw properties of every row that has them and set its pending pairs (from
    # ``pend``) over them; rows that must be read through Python are marked PROPS_FROM_DICT.
    # -1: no memory.
    cdef Py_ssize_t r
    cdef int state
    for r in range(n):
        if rows[r].props_state == PROPS_RAW or rows[r].props_state == PROPS_RAW_PENDING:
            state = _split_raw(&rows[r], entries)
            if state < 0:
                return -1
            if state:
                rows[r].props_state = PROPS_FROM_DICT
                continue
            if rows[r].props_state == PROPS_RAW_PENDING and \
                    _merge_pending(&rows[r], entries, pend) < 0:
                return -1
            rows[r].props_state = PROPS_READY
    return 0


cdef object _columns(Row *rows, Py_ssize_t n, Entries *e_in, object alloc):
    # Measure the rows, allocate the column buffers and fill them (the rows' pairs are ready).
    # ``alloc(size)``, when given, allocates the body data (nearly all the bytes), for example
    # from Arrow's memory pool, which reuses its pages instead of mapping fresh ones each time.
    cdef Entries entries = e_in[0]
    cdef Py_ssize_t r, i, t
    cdef Sizes z
    cdef int32_t p_topic = 0, p_broker = 0, p_msg_id = 0, p_oid = 0, p_tags = 0, p_keys = 0
    cdef int32_t p_tok = 0, p_body = 0, p_names = 0, p_values = 0, p_entries = 0, p_born = 0
    cdef int32_t p_store = 0
    cdef Span v
    cdef const Entry *e
    cdef int32_t *c_topic_off
    cdef int32_t *c_broker_off
    cdef int32_t *c_queue_id
    cdef int64_t *c_queue_offset
    cdef int32_t *c_msg_id_off
    cdef int32_t *c_oid_off
    cdef unsigned char *c_tags_valid
    cdef int32_t *c_tags_off
    cdef int32_t *c_keys_off
    cdef int32_t *c_tok_off
    cdef int32_t *c_body_off
    cdef int32_t *c_props_off
    cdef int32_t *c_names_off
    cdef int32_t *c_values_off
    cdef int64_t *c_born_ts
    cdef int64_t *c_store_ts
    cdef int32_t *c_born_off
    cdef int32_t *c_store_off
    cdef int32_t *c_reconsume
    cdef char *c_topic
    cdef char *c_broker
    cdef char *c_msg_id
    cdef char *c_oid
    cdef char *c_tags
    cdef char *c_tok
    cdef char *c_body
    cdef char *c_names
    cdef char *c_values
    cdef char *c_born
    cdef char *c_store
    cdef Py_buffer body_view
    cdef bint body_held = False
    with nogil:
        _measure(rows, n, entries.items, &z)
    if max(z.topic, z.broker, z.msg_id, z.oid, z.tags, z.keys, z.body, z.prop_names,
           z.prop_values, z.born_host, z.store_host, z.entries) > INT32_LIMIT:
        return None

    topic_off, topic_data = _alloc(4 * (n + 1)), _alloc(z.topic)
    broker_off, broker_data = _alloc(4 * (n + 1)), _alloc(z.broker)
    queue_id, queue_offset = _alloc(4 * n), _alloc(8 * n)
    msg_id_off, msg_id_data = _alloc(4 * (n + 1)), _alloc(z.msg_id)
    oid_off, oid_data = _alloc(4 * (n + 1)), _alloc(z.oid)
    tags_valid = _alloc((n + 7) // 8) if z.tags_null else None
    tags_off, tags_data = _alloc(4 * (n + 1)), _alloc(z.tags)
    keys_off, tok_off, tok_data = _alloc(4 * (n + 1)), _alloc(4 * (z.key_tokens + 1)), \
        _alloc(z.keys)
    body_off = _alloc(4 * (n + 1))
    body_data = _alloc(z.body) if alloc is None or z.body == 0 else alloc(z.body)
    props_off = _alloc(4 * (n + 1))
    names_off, names_data = _alloc(4 * (z.entries + 1)), _alloc(z.prop_names)
    values_off, values_data = _alloc(4 * (z.entries + 1)), _alloc(z.prop_values)
    born_ts, store_ts = _alloc(8 * n), _alloc(8 * n)
    born_off, born_data = _alloc(4 * (n + 1)), _alloc(z.born_host)
    store_off, store_data = _alloc(4 * (n + 1)), _alloc(z.store_host)
    reconsume = _alloc(4 * n)

    c_topic_off, c_topic = <int32_t *> _buf(topic_off), _buf(topic_data)
    c_broker_off, c_broker = <int32_t *> _buf(broker_off), _buf(broker_data)
    c_queue_id, c_queue_offset = <int32_t *> _buf(queue_id), <int64_t *> _buf(queue_offset)
    c_msg_id_off, c_msg_id = <int32_t *> _buf(msg_id_off), _buf(msg_id_data)
    c_oid_off, c_oid = <int32_t *> _buf(oid_off), _buf(oid_data)
    c_tags_valid = <unsigned char *> (_buf(tags_valid) if tags_valid is not None else NULL)
    c_tags_off, c_tags = <int32_t *> _buf(tags_off), _buf(tags_data)
    c_keys_off, c_tok_off, c_tok = <int32_t *> _buf(keys_off), <int32_t *> _buf(tok_off), \
        _buf(tok_data)
    c_body_off = <int32_t *> _buf(body_off)
    c_props_off = <int32_t *> _buf(props_off)
    c_names_off, c_names = <int32_t *> _buf(names_off), _buf(names_data)
    c_values_off, c_values = <int32_t *> _buf(values_off), _buf(values_data)
    c_born_ts, c_store_ts = <int64_t *> _buf(born_ts), <int64_t *> _buf(store_ts)
    c_born_off, c_born = <int32_t *> _buf(born_off), _buf(born_data)
    c_store_off, c_store = <int32_t *> _buf(store_off), _buf(store_data)
    c_reconsume = <int32_t *> _buf(reconsume)
    if alloc is None or z.body == 0:
        c_body = _buf(body_data)
    else:
        c_body = _hold_writable(body_data, &body_view, z.body)
        body_held = True
    try:
        with nogil:
            c_topic_off[0] = c_broker_off[0] = c_msg_id_off[0] = c_oid_off[0] = 0
            c_tags_off[0] = c_keys_off[0] = c_tok_off[0] = c_body_off[0] = c_props_off[0] = 0
            c_names_off[0] = c_values_off[0] = c_born_off[0] = c_store_off[0] = 0
            if c_tags_valid != NULL:
                memset(c_tags_valid, 0, (n + 7) // 8)
            for r in range(n):
                _put_text(c_topic_off, c_topic, r, &p_topic, rows[r].topic.p, rows[r].topic.n)
                _put_text(c_broker_off, c_broker, r, &p_broker, rows[r].broker.p,
                          rows[r].broker.n)
                c_queue_id[r] = rows[r].queue_id
                c_queue_offset[r] = rows[r].queue_offset
                if rows[r].uniq >= 0 and entries.items[rows[r].uniq].value.n > 0:
                    v = entries.items[rows[r].uniq].value
                    _put_text(c_msg_id_off, c_msg_id, r, &p_msg_id, v.p, v.n)
                else:
                    _put_oid(c_msg_id_off, c_msg_id, r, &p_msg_id, &rows[r])
                _put_oid(c_oid_off, c_oid, r, &p_oid, &rows[r])
                if rows[r].tags >= 0:
                    v = entries.items[rows[r].tags].value
                    if c_tags_valid != NULL:
                        c_tags_valid[r >> 3] |= <unsigned char> (1 << (r & 7))
                    _put_text(c_tags_off, c_tags, r, &p_tags, v.p, v.n)
                else:
                    c_tags_off[r + 1] = p_tags
                if rows[r].keys >= 0:
                    v = entries.items[rows[r].keys].value
                    t = 0
                    while t < v.n:
                        if v.p[t] == 32:
                            t += 1
                            continue
                        i = t
                        while i < v.n and v.p[i] != 32:
                            i += 1
                        memcpy(c_tok + p_keys, v.p + t, i - t)
                        p_keys += <int32_t> (i - t)
                        p_tok += 1
                        c_tok_off[p_tok] = p_keys
                        t = i
                c_keys_off[r + 1] = p_tok
                _put_text(c_body_off, c_body, r, &p_body, rows[r].body.p, rows[r].body.n)
                for i in range(rows[r].first_entry, rows[r].first_entry + rows[r].n_entries):
                    e = &entries.items[i]
                    _put_text(c_names_off, c_names, p_entries, &p_names, e.name.p, e.name.n)
                    _put_text(c_values_off, c_values, p_entries, &p_values, e.value.p,
                              e.value.n)
                    p_entries += 1
                c_props_off[r + 1] = p_entries
                c_born_ts[r] = rows[r].born_ts
                c_store_ts[r] = rows[r].store_ts
                _put_text(c_born_off, c_born, r, &p_born, rows[r].born_host.p,
                          rows[r].born_host.n)
                _put_text(c_store_off, c_store, r, &p_store, rows[r].store_host.p,
                          rows[r].store_host.n)
                c_reconsume[r] = rows[r].reconsume
    finally:
        if body_held:
            PyBuffer_Release(&body_view)
    return {
        "rows": n,
        "key_tokens": z.key_tokens,
        "entries": z.entries,
        "tags_null": z.tags_null,
        "topic": (topic_off, topic_data),
        "broker_name": (broker_off, broker_data),
        "queue_id": (queue_id,),
        "queue_offset": (queue_offset,),
        "msg_id": (msg_id_off, msg_id_data),
        "offset_msg_id": (oid_off, oid_data),
        "tags": (tags_valid, tags_off, tags_data),
        "keys": (keys_off, tok_off, tok_data),
        "body": (body_off, body_data),
        "properties": (props_off, names_off, names_data, values_off, values_data),
        "born_timestamp": (born_ts,),
        "store_timestamp": (store_ts,),
        "born_host": (born_off, born_data),
        "store_host": (store_off, store_data),
        "reconsume_times": (reconsume,),
    }


def message_columns(list msgs not None):
    """The buffers of the sink's Arrow columns for ``msgs``, or None.

    None means the list holds something the columnar path does not take (a value of an
    unexpected type, a property that is not text, a column over 2 GiB); the caller then builds
    the columns from Python values, which gives the same table or the same error. Otherwise a
    dict of column name to a tuple of buffers (``bytearray``, little-endian, Arrow layout):
    fixed-width columns as one data buffer, strings as (offsets, data), ``tags`` as (validity or
    None, offsets, data), ``keys`` as (list offsets, string offsets, data) and ``properties``
    as (map offsets, name offsets, name data, value offsets, value data); plus the counts
    ``rows``, ``key_tokens``, ``entries``, ``tags_null`` and ``python_rows`` (rows whose
    properties had to be read through Python: not valid UTF-8, or over 64 pairs).
    """
    # A snapshot: the rows point into the messages' values, and the list may change (another
    # thread) while the rows are split without the GIL.
    cdef tuple items = tuple(msgs)
    cdef Py_ssize_t n = len(items), r, i, t
    cdef Row *rows = NULL
    cdef Entries entries, pend
    cdef list refs = []
    cdef int failed = 0
    cdef object pending, last_pending = None
    cdef Py_ssize_t last_first = 0, last_n = 0, slow = 0
    entries.items = pend.items = NULL
    entries.size = pend.size = 0
    entries.cap = pend.cap = 0
    rows = <Row *> malloc((n if n else 1) * sizeof(Row))
    if rows == NULL:
        raise MemoryError()
    try:
        try:
            for r in range(n):
                _read_row(items[r], &rows[r], refs)
                if rows[r].props_state == PROPS_RAW_PENDING:
                    # The messages of one pull share their pending dict: its pairs are read once.
                    pending = _get(items[r], S_PROPS_PENDING)
                    if pending is not last_pending:
                        _pending_entries(<dict> pending, &pend, refs, &rows[r])
                        last_pending = pending
                        last_first, last_n = rows[r].pend_first, rows[r].pend_n
                    rows[r].pend_first, rows[r].pend_n = last_first, last_n
        except (TypeError, OverflowError, ValueError, UnicodeError):
            return None
        with nogil:
            failed = _split_rows(rows, n, &entries, pend.items)
        if failed:
            raise MemoryError()
        try:
            for r in range(n):
                if rows[r].props_state == PROPS_FROM_DICT:
                    _pairs_from_dict(items[r], &rows[r], &entries, refs)
                    slow += 1
        except (TypeError, UnicodeError):
            return None
        out = _columns(rows, n, &entries, None)
        out["python_rows"] = slow
        return out
    finally:
        free(rows)
        free(entries.items)
        free(pend.items)


# ---------------------------------------------------------------------------------------------
# Stored chunks: the records of a pull body straight to the sink's Arrow columns
#
# A sink does not need a MessageExt per message: the pull loop checks a FOUND body with
# ``scan_records`` (one pass, no objects) and keeps it as it came; ``record_columns`` later reads
# the rows out of the bodies (with the GIL only for the host texts, which are cached) and fills
# the same buffers as ``message_columns``.


def scan_records(bytes data not None, bytes topic not None):
    """``(count, first_offset, last_offset, body_bytes, queue_id)`` of a pull body that the
    columnar path can keep as it is, else None.

    It can when every record is well formed, belongs to ``topic`` and one queue, with rising
    offsets, and is plain: not compressed, not an inner batch, both hosts IPv4. Anything else
    (and an empty body) is None: the caller decodes the body the usual way, which inflates,
    unwraps or reports what is wrong.
    """
    cdef const unsigned char *buf = <const unsigned char *> PyBytes_AS_STRING(data)
    cdef const char *want = PyBytes_AS_STRING(topic)
    cdef Py_ssize_t want_len = PyBytes_GET_SIZE(topic)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data), pos = 0, end, p, count = 0
    cdef int32_t total, magic, sys_flag, body_len, topic_len, queue_id = 0
    cdef int16_t props_len
    cdef int64_t offset, first = 0, last = 0, size = 0
    if n == 0:
        return None
    while pos < n:
        if n - pos < MIN_RECORD:
            return None
        total = _i32(buf + pos)
        magic = _i32(buf + pos + 4)
        if total < MIN_RECORD or total > n - pos or (magic != MAGIC_V1 and magic != MAGIC_V2):
            return None
        end = pos + total
        sys_flag = _i32(buf + pos + 36)
        if sys_flag & (BORNHOST_V6 | STOREHOST_V6 | COMPRESSED | UNWRAP_BOTH):
            return None
        p = pos + 72
        body_len = _i32(buf + p + 12)
        p += TAIL_SIZE
        if magic == MAGIC_V1:
            if body_len < 0 or body_len > end - p - 3:
                return None
            p += body_len
            topic_len = buf[p]
            if topic_len > 127:
                return None
            p += 1
        else:
            if body_len < 0 or body_len > end - p - 4:
                return None
            p += body_len
            topic_len = _i16(buf + p)
            p += 2
        if topic_len != want_len or topic_len > end - p - 2 or memcmp(buf + p, want, want_len):
            return None
        p += topic_len
        props_len = _i16(buf + p)
        p += 2
        if props_len < 0 or p + props_len != end:
            return None
        offset = _i64(buf + pos + 20)
        if count == 0:
            first = offset
            queue_id = _i32(buf + pos + 12)
        elif offset <= last or _i32(buf + pos + 12) != queue_id:
            return None
        last = offset
        size += body_len
        count += 1
        pos = end
    return (count, first, last, size, queue_id)


cdef int _read_records(bytes data, object broker, object pending, Row *rows, Py_ssize_t start,
                       Py_ssize_t limit, list refs) except -1:
    # Fills rows[start:] from the records of ``data`` (accepted by ``scan_records``); returns
    # how many, or raises ValueError when they would not fit or a record is not well formed
    # (its lengths are checked again here, as the caller's word is all this has).
    cdef const unsigned char *buf = <const unsigned char *> PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data), pos = 0, p, r = start
    cdef int32_t total, magic, body_len, topic_len
    cdef Row *row
    cdef tuple born, store
    cdef object prev_born = None, prev_store = None
    cdef Span broker_span = _utf8(broker)
    cdef int state = PROPS_RAW if pending is None else PROPS_RAW_PENDING
    refs.append(broker)
    refs.append(data)
    while pos < n:
        if r >= limit:
            raise ValueError("more records than counted")
        if n - pos < MIN_RECORD:
            raise ValueError("truncated record")
        row = &rows[r]
        total = _i32(buf + pos)
        magic = _i32(buf + pos + 4)
        if total < MIN_RECORD or total > n - pos or (magic != MAGIC_V1 and magic != MAGIC_V2) \
                or _i32(buf + pos + 36) & (BORNHOST_V6 | STOREHOST_V6 | COMPRESSED | UNWRAP_BOTH):
            raise ValueError("not a record scan_records accepts")
        row.queue_id = _i32(buf + pos + 12)
        row.queue_offset = _i64(buf + pos + 20)
        row.oid_offset = _i64(buf + pos + 28)
        row.born_ts = _i64(buf + pos + 40)
        born = _host4(_u32(buf + pos + 48), _i32(buf + pos + 52), 0)
        row.store_ts = _i64(buf + pos + 56)
        store = _host4(_u32(buf + pos + 64), _i32(buf + pos + 68), 1)
        row.reconsume = _i32(buf + pos + 72)
        body_len = _i32(buf + pos + 84)
        p = pos + 88
        if body_len < 0 or body_len > pos + total - p - (3 if magic == MAGIC_V1 else 4):
            raise ValueError("a body length past its record")
        row.body.p = <const char *> buf + p
        row.body.n = body_len
        p += body_len
        if magic == MAGIC_V1:
            topic_len = buf[p]
            p += 1
        else:
            topic_len = _i16(buf + p)
            p += 2
        if topic_len < 0 or topic_len > pos + total - p - 2:
            raise ValueError("a topic length past its record")
        row.topic.p = <const char *> buf + p
        row.topic.n = topic_len
        p += topic_len + 2
        if _i16(buf + p - 2) != pos + total - p:
            raise ValueError("a properties length other than its record's rest")
        row.props.p = <const char *> buf + p
        row.props.n = pos + total - p
        row.props_state = state
        row.broker = broker_span
        # The cached host tuples are shared by many rows: each is kept alive once.
        if born is not prev_born:
            refs.append(born)
            prev_born = born
        if store is not prev_store:
            refs.append(store)
            prev_store = store
        row.born_host = _utf8(born[0])
        row.store_host = _utf8(store[0])
        row.oid = _utf8(store[1])
        row.oid_host = True
        pos += total
        r += 1
    return r - start


def record_columns(list chunks not None, Py_ssize_t rows_total, alloc=None):
    """The buffers of ``message_columns`` for stored chunks, without a message object per row.

    ``chunks`` holds ``(data, broker_name, pending)`` per chunk: a pull body that
    ``scan_records`` accepted, the broker name of its queue and the properties the pull adds
    (``MIN_OFFSET``/``MAX_OFFSET``; None for none), ``rows_total`` the records of all bodies.
    Each row is what the decoded, stamped message would give ``message_columns``. None when a
    column would exceed 2 GiB or a body holds a different number of records. ``alloc(size)``,
    if given, returns the writable buffer for the body column's data (else a ``bytearray``).
    """
    cdef Py_ssize_t n = rows_total, r, c, k = 0, start, slow = 0
    cdef Row *rows = NULL
    cdef Entries entries, pend
    cdef list refs = []
    cdef list pendings = []
    cdef int failed = 0
    if n < 0 or <size_t> n > (<size_t> PY_SSIZE_T_MAX) // sizeof(Row):
        return None
    entries.items = pend.items = NULL
    entries.size = pend.size = 0
    entries.cap = pend.cap = 0
    rows = <Row *> malloc((n if n else 1) * sizeof(Row))
    if rows == NULL:
        raise MemoryError()
    try:
        starts = []
        try:
            for item in tuple(chunks):
                data, broker, pending = item
                if not (PyBytes_CheckExact(data) and PyUnicode_CheckExact(broker)
                        and (pending is None or type(pending) is dict)):
                    return None
                starts.append(k)
                pendings.append(pending)
                start = k
                k += _read_records(data, broker, pending, rows, k, n, refs)
                if pending is not None and k > start:
                    # The chunk's pending pairs are read once; every row of it points at them.
                    _pending_entries(<dict> pending, &pend, refs, &rows[start])
                    for r in range(start + 1, k):
                        rows[r].pend_first, rows[r].pend_n = rows[start].pend_first, \
                            rows[start].pend_n
        except (TypeError, ValueError, UnicodeError):
            return None
        if k != n:
            return None
        with nogil:
            failed = _split_rows(rows, n, &entries, pend.items)
        if failed:
            raise MemoryError()
        try:
            c = 0
            for r in range(n):
                while c + 1 < len(starts) and r >= starts[c + 1]:
                    c += 1
                if rows[r].props_state == PROPS_FROM_DICT:
                    pending = pendings[c]
                    props = _parse_text(PyUnicode_DecodeUTF8(rows[r].props.p, rows[r].props.n,
                                                             b"replace"))
                    if pending is not None:
                        PyDict_Update(props, pending)
                    _put_dict(props, &rows[r], &entries, refs)
                    slow += 1
        except (TypeError, UnicodeError):
            return None
        out = _columns(rows, n, &entries, alloc)
        out["python_rows"] = slow
        return out
    finally:
        free(rows)
        free(entries.items)
        free(pend.items)


# ---------------------------------------------------------------------------------------------
# The JSON header of a remoting command (the compiled twin of ``command._decode_json_header``'s
# parse step)
#
# Brokers write every header the same way: one flat object of known keys, integers, a few
# strings and the ``extFields`` object of strings, with no escapes. ``json_header`` reads exactly
# that and returns ``None`` for anything else (an escape, a fraction, an array, a nested object
# outside ``extFields``, a value of an unexpected type, an integer outside int32 where the
# command keeps it, bytes after the object), so that the pure decoder, which accepts all of
# JSON, decides and words the error. Where it answers, it answers what the pure decoder would.

cdef enum:
    H_OTHER = 0
    H_CODE = 1
    H_EXT = 2
    H_FLAG = 3
    H_LANGUAGE = 4
    H_OPAQUE = 5
    H_REMARK = 6
    H_VERSION = 7


cdef inline Py_ssize_t _skip_ws(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    while i < n and (p[i] == 32 or p[i] == 9 or p[i] == 10 or p[i] == 13):
        i += 1
    return i


cdef inline Py_ssize_t _string_end(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """Index of the closing quote of a string whose text starts at ``i``; -1 for an escape, a
    control character or no closing quote."""
    cdef unsigned char c
    while i < n:
        c = p[i]
        if c == 34:  # "
            return i
        if c == 92 or c < 32:  # backslash, control characters
            return -1
        i += 1
    return -1


cdef inline bint _key_is(const unsigned char *p, Py_ssize_t n, const char *name,
                         Py_ssize_t name_len) noexcept nogil:
    return n == name_len and memcmp(p, name, <size_t>n) == 0


cdef int _header_key(const unsigned char *p, Py_ssize_t n) noexcept nogil:
    if _key_is(p, n, b"code", 4):
        return H_CODE
    if _key_is(p, n, b"extFields", 9):
        return H_EXT
    if _key_is(p, n, b"flag", 4):
        return H_FLAG
    if _key_is(p, n, b"language", 8):
        return H_LANGUAGE
    if _key_is(p, n, b"opaque", 6):
        return H_OPAQUE
    if _key_is(p, n, b"remark", 6):
        return H_REMARK
    if _key_is(p, n, b"version", 7):
        return H_VERSION
    return H_OTHER


cdef inline bint _literal(const unsigned char *p, Py_ssize_t i, Py_ssize_t n, const char *word,
                          Py_ssize_t length) noexcept nogil:
    return i + length <= n and memcmp(p + i, word, <size_t>length) == 0


cdef Py_ssize_t _json_number(const unsigned char *p, Py_ssize_t i, Py_ssize_t n,
                             int64_t *value) noexcept nogil:
    """End of a JSON integer starting at ``i`` with its value (saturated beyond 18 digits);
    -1 for anything that is not a plain integer (a fraction or an exponent included)."""
    cdef bint negative = False
    cdef Py_ssize_t start
    cdef int64_t v = 0
    if i < n and p[i] == 45:  # -
        negative = True
        i += 1
    start = i
    while i < n and 48 <= p[i] <= 57:
        if i - start < 18:
            v = v * 10 + (p[i] - 48)
        else:
            v = 1000000000000000000  # beyond any int32: the caller declines it
        i += 1
    if i == start or (p[start] == 48 and i - start > 1):
        return -1  # no digits, or a leading zero (not JSON)
    if i - start > 640:
        # Left to json.loads, which applies the process's limit on int digits (4300 unless
        # set otherwise; 640 is the lowest a process may set), so both readers agree under
        # any setting. No broker writes such a number.
        return -1
    if i < n and (p[i] == 46 or p[i] == 101 or p[i] == 69):  # . e E
        return -1
    value[0] = -v if negative else v
    return i


cdef object _json_text(const unsigned char *p, Py_ssize_t start, Py_ssize_t end):
    """The text of a string's bytes, or None when they are not valid UTF-8."""
    try:
        return PyUnicode_DecodeUTF8(<const char *>(p + start), end - start, NULL)
    except UnicodeDecodeError:
        return None


cdef Py_ssize_t _json_ext(const unsigned char *p, Py_ssize_t i, Py_ssize_t n, dict out) except -2:
    """Read an ``extFields`` object of string values starting at its ``{`` into ``out``; the
    index after its ``}``, or -1 for anything else."""
    cdef Py_ssize_t key_end, value_end
    cdef object key, value
    i = _skip_ws(p, i + 1, n)
    if i < n and p[i] == 125:  # }
        return i + 1
    while True:
        if i >= n or p[i] != 34:
            return -1
        key_end = _string_end(p, i + 1, n)
        if key_end < 0:
            return -1
        key = _json_text(p, i + 1, key_end)
        if key is None:
            return -1
        i = _skip_ws(p, key_end + 1, n)
        if i >= n or p[i] != 58:  # :
            return -1
        i = _skip_ws(p, i + 1, n)
        if i >= n or p[i] != 34:
            return -1  # a value that is not a string: the pure decoder converts it
        value_end = _string_end(p, i + 1, n)
        if value_end < 0:
            return -1
        value = _json_text(p, i + 1, value_end)
        if value is None:
            return -1
        out[key] = value
        i = _skip_ws(p, value_end + 1, n)
        if i < n and p[i] == 44:  # ,
            i = _skip_ws(p, i + 1, n)
            continue
        if i < n and p[i] == 125:
            return i + 1
        return -1


def json_header(bytes header not None):
    """``(code, language, version, opaque, flag, remark, ext_fields)`` of a JSON command header,
    or None when the header is not of the plain shape brokers write (see above). ``language``
    is the name given or None when absent; the integers default to 0."""
    cdef const unsigned char *p = <const unsigned char *>PyBytes_AS_STRING(header)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(header)
    cdef Py_ssize_t i, key_end, value_end
    cdef int key
    cdef int64_t number
    cdef int64_t ints[8]
    cdef object language = None, remark = None, ext = None
    cdef object text
    cdef dict fields
    memset(ints, 0, sizeof(ints))
    i = _skip_ws(p, 0, n)
    if i >= n or p[i] != 123:  # {
        return None
    i = _skip_ws(p, i + 1, n)
    if i < n and p[i] == 125:
        i += 1
    else:
        while True:
            if i >= n or p[i] != 34:
                return None
            key_end = _string_end(p, i + 1, n)
            if key_end < 0:
                return None
            key = _header_key(p + i + 1, key_end - i - 1)
            if key == H_OTHER and _json_text(p, i + 1, key_end) is None:
                return None  # a key the pure decoder cannot even read
            i = _skip_ws(p, key_end + 1, n)
            if i >= n or p[i] != 58:
                return None
            i = _skip_ws(p, i + 1, n)
            if i >= n:
                return None
            if p[i] == 34:
                value_end = _string_end(p, i + 1, n)
                if value_end < 0:
                    return None
                if key == H_LANGUAGE or key == H_REMARK or key == H_OTHER:
                    text = _json_text(p, i + 1, value_end)
                    if text is None:
                        return None
                    if key == H_LANGUAGE:
                        language = text
                    elif key == H_REMARK:
                        remark = text
                else:
                    return None  # a number given as a string, or a string for extFields
                i = value_end + 1
            elif p[i] == 45 or 48 <= p[i] <= 57:
                i = _json_number(p, i, n, &number)
                if i < 0:
                    return None
                if key == H_CODE or key == H_FLAG or key == H_OPAQUE or key == H_VERSION:
                    if number < -2147483648 or number > 2147483647:
                        return None
                    ints[key] = number
                elif key != H_OTHER:
                    return None  # a number for language, remark or extFields
            elif p[i] == 123:
                if key != H_EXT:
                    return None
                fields = {}
                i = _json_ext(p, i, n, fields)
                if i < 0:
                    return None
                ext = fields
            elif _literal(p, i, n, b"null", 4):
                if key == H_CODE or key == H_FLAG or key == H_OPAQUE or key == H_VERSION:
                    ints[key] = 0
                elif key == H_LANGUAGE:
                    language = None
                elif key == H_REMARK:
                    remark = None
                elif key == H_EXT:
                    ext = None
                i += 4
            elif _literal(p, i, n, b"true", 4) or _literal(p, i, n, b"false", 5):
                if key != H_OTHER:
                    return None
                i += 4 if p[i] == 116 else 5
            else:
                return None
            i = _skip_ws(p, i, n)
            if i < n and p[i] == 44:
                i = _skip_ws(p, i + 1, n)
                continue
            if i < n and p[i] == 125:
                i += 1
                break
            return None
    if _skip_ws(p, i, n) != n:
        return None
    return (ints[H_CODE], language, ints[H_VERSION], ints[H_OPAQUE], ints[H_FLAG], remark, ext)
