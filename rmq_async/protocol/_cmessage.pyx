# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled twin of the stored-record decoder in :mod:`rmq_async.protocol.message`.

Same inputs, same :class:`MessageExt` results (properties and the offset message id left raw,
as the pure decoder leaves them), the same :class:`ProtocolError` messages in the same order of
checks. :mod:`rmq_async.protocol.message` chooses between the two and calls :func:`install`
before first use.

Messages are created without running ``MessageExt.__init__``: the object is allocated and its
slots are filled directly. The slot offsets are read from the class's member descriptors when
this module is imported, and the import fails (so the pure decoder is used) if the class does
not have the expected layout.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_Append, PyList_GET_SIZE
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
from libc.string cimport memcmp

from types import MemberDescriptorType

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


def decode_properties(str text not None):
    """Compiled :func:`rmq_async.protocol.message.decode_properties`."""
    return _parse_text(text)


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
        PyList_Append(out, msg)
        pos = end
        index += 1


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
        if decompress and sys_flag & COMPRESSED:
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
        if unwrap_batch and (sys_flag & UNWRAP_BOTH) == UNWRAP_BOTH:
            _unwrap_batch(msg, out)
        else:
            PyList_Append(out, msg)
        pos = end
