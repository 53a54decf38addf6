import java.lang.reflect.Field;
import java.lang.reflect.Modifier;
import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.security.MessageDigest;
import java.util.ArrayList;
import java.util.Base64;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

import com.alibaba.fastjson.JSON;
import com.alibaba.fastjson.JSONArray;
import com.alibaba.fastjson.JSONObject;
import com.alibaba.fastjson.serializer.SerializerFeature;

import io.netty.buffer.ByteBuf;
import io.netty.buffer.Unpooled;

import org.apache.rocketmq.acl.common.AclClientRPCHook;
import org.apache.rocketmq.acl.common.SessionCredentials;
import org.apache.rocketmq.common.BoundaryType;
import org.apache.rocketmq.common.UtilAll;
import org.apache.rocketmq.common.compression.CompressionType;
import org.apache.rocketmq.common.compression.CompressorFactory;
import org.apache.rocketmq.common.consumer.ConsumeFromWhere;
import org.apache.rocketmq.common.message.Message;
import org.apache.rocketmq.common.message.MessageAccessor;
import org.apache.rocketmq.common.message.MessageClientExt;
import org.apache.rocketmq.common.message.MessageDecoder;
import org.apache.rocketmq.common.message.MessageExt;
import org.apache.rocketmq.common.message.MessageExtBrokerInner;
import org.apache.rocketmq.common.message.MessageQueue;
import org.apache.rocketmq.common.message.MessageVersion;
import org.apache.rocketmq.common.sysflag.MessageSysFlag;
import org.apache.rocketmq.remoting.CommandCustomHeader;
import org.apache.rocketmq.remoting.protocol.LanguageCode;
import org.apache.rocketmq.remoting.protocol.RemotingCommand;
import org.apache.rocketmq.remoting.protocol.RemotingSerializable;
import org.apache.rocketmq.remoting.protocol.SerializeType;
import org.apache.rocketmq.remoting.protocol.body.LockBatchRequestBody;
import org.apache.rocketmq.remoting.protocol.filter.FilterAPI;
import org.apache.rocketmq.remoting.protocol.heartbeat.ConsumeType;
import org.apache.rocketmq.remoting.protocol.heartbeat.ConsumerData;
import org.apache.rocketmq.remoting.protocol.heartbeat.HeartbeatData;
import org.apache.rocketmq.remoting.protocol.heartbeat.MessageModel;
import org.apache.rocketmq.remoting.protocol.heartbeat.ProducerData;
import org.apache.rocketmq.remoting.protocol.heartbeat.SubscriptionData;
import org.apache.rocketmq.store.MessageExtEncoder;
import org.apache.rocketmq.store.config.MessageStoreConfig;

/**
 * Reference encoder/decoder for tests/broker/test_oracle.py, built on the RocketMQ jars.
 *
 * <pre>
 *   encode   cases.json  frames.bin           commands built as the Java client/broker builds them,
 *                                             written as NettyEncoder writes them (fastEncodeHeader
 *                                             + body), frames concatenated in case order
 *   decode   cases.json  frames.bin out.jsonl frames (written by rmq_async) decoded with
 *                                             RemotingCommand.decode + decodeCommandCustomHeader;
 *                                             one JSON line per frame
 *   messages msgs.json   records.bin out.jsonl stored-message records written with
 *                                             MessageDecoder.encode or the store's MessageExtEncoder,
 *                                             concatenated; then Java's own client-side decode of
 *                                             those bytes, one JSON line per record
 * </pre>
 *
 * Case format: see the Python test (CommandCase.to_json / StoredCase.to_json).
 */
public class OracleCodec {
    private static final String HEADER_PACKAGE = "org.apache.rocketmq.remoting.protocol.header.";

    public static void main(String[] args) throws Exception {
        String mode = args[0];
        JSONArray cases = JSON.parseArray(new String(Files.readAllBytes(Paths.get(args[1])), StandardCharsets.UTF_8));
        switch (mode) {
            case "encode":
                encodeAll(cases, args[2]);
                break;
            case "decode":
                decodeAll(cases, args[2], args[3]);
                break;
            case "messages":
                messagesAll(cases, args[2], args[3]);
                break;
            default:
                throw new IllegalArgumentException("unknown mode " + mode);
        }
    }

    // ------------------------------------------------------------------ commands

    static Class<?> headerClass(String name) throws ClassNotFoundException {
        return Class.forName(name.contains(".") ? name : HEADER_PACKAGE + name);
    }

    static Field findField(Class<?> cls, String name) {
        for (Class<?> c = cls; c != null && c != Object.class; c = c.getSuperclass()) {
            try {
                Field f = c.getDeclaredField(name);
                f.setAccessible(true);
                return f;
            } catch (NoSuchFieldException e) {
                // look in the superclass
            }
        }
        throw new IllegalArgumentException(cls.getName() + " has no field " + name);
    }

    static Object parseValue(Class<?> type, String value) {
        if (type == String.class) {
            return value;
        }
        if (type == Integer.class || type == int.class) {
            return Integer.parseInt(value);
        }
        if (type == Long.class || type == long.class) {
            return Long.parseLong(value);
        }
        if (type == Boolean.class || type == boolean.class) {
            return Boolean.parseBoolean(value);
        }
        if (type == BoundaryType.class) {
            return BoundaryType.getType(value);
        }
        throw new IllegalArgumentException("unsupported field type " + type);
    }

    static CommandCustomHeader buildHeader(JSONObject spec) throws Exception {
        if (spec == null) {
            return null;
        }
        Class<?> cls = headerClass(spec.getString("class"));
        CommandCustomHeader header = (CommandCustomHeader) cls.getDeclaredConstructor().newInstance();
        JSONArray fields = spec.getJSONArray("fields");
        for (int i = 0; i < fields.size(); i++) {
            JSONArray kv = fields.getJSONArray(i);
            Field f = findField(cls, kv.getString(0));
            f.set(header, parseValue(f.getType(), kv.getString(1)));
        }
        return header;
    }

    static byte[] pattern(int size) {
        byte[] out = new byte[size];
        for (int i = 0; i < size; i++) {
            out[i] = (byte) ((i * 131 + (i >> 8)) & 0xFF);
        }
        return out;
    }

    static Message batchItem(JSONObject m) {
        Message msg = new Message();
        msg.setTopic(m.getString("topic"));
        msg.setBody(Base64.getDecoder().decode(m.getString("body")));
        msg.setFlag(m.getIntValue("flag"));
        JSONArray props = m.getJSONArray("props");
        for (int i = 0; i < props.size(); i++) {
            JSONArray kv = props.getJSONArray(i);
            MessageAccessor.putProperty(msg, kv.getString(0), kv.getString(1));
        }
        return msg;
    }

    static byte[] buildBody(JSONObject body) throws Exception {
        String kind = body.getString("kind");
        switch (kind) {
            case "none":
                return null;
            case "raw":
                return Base64.getDecoder().decode(body.getString("data"));
            case "pattern":
                return pattern(body.getIntValue("size"));
            case "heartbeat": {
                HeartbeatData hb = new HeartbeatData();
                hb.setClientID(body.getString("clientID"));
                hb.setHeartbeatFingerprint(body.getIntValue("fingerprint"));
                hb.setWithoutSub(body.getBooleanValue("withoutSub"));
                JSONArray producers = body.getJSONArray("producers");
                for (int i = 0; i < producers.size(); i++) {
                    ProducerData pd = new ProducerData();
                    pd.setGroupName(producers.getString(i));
                    hb.getProducerDataSet().add(pd);
                }
                JSONArray consumers = body.getJSONArray("consumers");
                for (int i = 0; i < consumers.size(); i++) {
                    JSONObject c = consumers.getJSONObject(i);
                    ConsumerData cd = new ConsumerData();
                    cd.setGroupName(c.getString("groupName"));
                    cd.setConsumeType(ConsumeType.valueOf(c.getString("consumeType")));
                    cd.setMessageModel(MessageModel.valueOf(c.getString("messageModel")));
                    cd.setConsumeFromWhere(ConsumeFromWhere.valueOf(c.getString("consumeFromWhere")));
                    cd.setUnitMode(c.getBooleanValue("unitMode"));
                    JSONArray subs = c.getJSONArray("subscriptions");
                    for (int j = 0; j < subs.size(); j++) {
                        JSONObject s = subs.getJSONObject(j);
                        SubscriptionData sd = FilterAPI.build(s.getString("topic"), s.getString("expression"),
                            s.getString("type"));
                        sd.setSubVersion(s.getLongValue("version"));
                        cd.getSubscriptionDataSet().add(sd);
                    }
                    hb.getConsumerDataSet().add(cd);
                }
                return hb.encode();
            }
            case "lock": {
                LockBatchRequestBody lock = new LockBatchRequestBody();
                lock.setConsumerGroup(body.getString("group"));
                lock.setClientId(body.getString("clientId"));
                lock.setOnlyThisBroker(body.getBooleanValue("onlyThisBroker"));
                JSONArray mqs = body.getJSONArray("mqs");
                for (int i = 0; i < mqs.size(); i++) {
                    JSONArray mq = mqs.getJSONArray(i);
                    lock.getMqSet().add(new MessageQueue(mq.getString(0), mq.getString(1), mq.getIntValue(2)));
                }
                return lock.encode();
            }
            case "batch": {
                List<Message> msgs = new ArrayList<>();
                JSONArray items = body.getJSONArray("messages");
                for (int i = 0; i < items.size(); i++) {
                    msgs.add(batchItem(items.getJSONObject(i)));
                }
                return MessageDecoder.encodeMessages(msgs);
            }
            default:
                throw new IllegalArgumentException("unknown body kind " + kind);
        }
    }

    static RemotingCommand buildCommand(JSONObject c) throws Exception {
        CommandCustomHeader header = buildHeader(c.getJSONObject("header"));
        String kind = c.getString("kind");
        int code = c.getIntValue("code");
        RemotingCommand cmd;
        if ("response".equals(kind)) {
            cmd = RemotingCommand.createResponseCommandWithHeader(code, header);
        } else {
            cmd = RemotingCommand.createRequestCommand(code, header);
            if ("oneway".equals(kind)) {
                cmd.markOnewayRPC();
            }
        }
        cmd.setOpaque(c.getIntValue("opaque"));
        cmd.setLanguage(LanguageCode.valueOf(c.getString("language")));
        cmd.setVersion(c.getIntValue("version"));
        cmd.setRemark(c.getString("remark"));
        cmd.setSerializeTypeCurrentRPC(SerializeType.valueOf(c.getString("serialize")));
        JSONArray map = c.getJSONArray("map");
        if (map != null) {
            HashMap<String, String> fields = new HashMap<>();
            for (int i = 0; i < map.size(); i++) {
                JSONArray kv = map.getJSONArray(i);
                fields.put(kv.getString(0), kv.getString(1));
            }
            cmd.setExtFields(fields);
        }
        JSONArray extras = c.getJSONArray("extras");
        for (int i = 0; i < extras.size(); i++) {
            JSONArray kv = extras.getJSONArray(i);
            cmd.addExtField(kv.getString(0), kv.getString(1));
        }
        byte[] body = buildBody(c.getJSONObject("body"));
        if (body != null) {
            cmd.setBody(body);
        }
        JSONArray acl = c.getJSONArray("acl");
        if (acl != null) {
            // What the client's RPC hook does just before the request is written.
            new AclClientRPCHook(new SessionCredentials(acl.getString(0), acl.getString(1)))
                .doBeforeRequest("127.0.0.1:10911", cmd);
        }
        return cmd;
    }

    static void encodeAll(JSONArray cases, String outPath) throws Exception {
        ByteBuf out = Unpooled.buffer();
        for (int i = 0; i < cases.size(); i++) {
            RemotingCommand cmd = buildCommand(cases.getJSONObject(i));
            // Exactly what NettyEncoder.encode writes to the channel.
            cmd.fastEncodeHeader(out);
            if (cmd.getBody() != null) {
                out.writeBytes(cmd.getBody());
            }
        }
        byte[] all = new byte[out.readableBytes()];
        out.readBytes(all);
        Files.write(Paths.get(outPath), all);
    }

    static String sha256(byte[] data) throws Exception {
        byte[] d = MessageDigest.getInstance("SHA-256").digest(data);
        StringBuilder sb = new StringBuilder();
        for (byte b : d) {
            sb.append(String.format("%02x", b & 0xFF));
        }
        return sb.toString();
    }

    static Map<String, Object> headerFields(Object header) throws Exception {
        Map<String, Object> out = new LinkedHashMap<>();
        for (Class<?> c = header.getClass(); c != null && c != Object.class; c = c.getSuperclass()) {
            for (Field f : c.getDeclaredFields()) {
                if (Modifier.isStatic(f.getModifiers()) || f.getName().startsWith("this")) {
                    continue;
                }
                f.setAccessible(true);
                Object v = f.get(header);
                out.put(f.getName(), v == null ? null : v.toString());
            }
        }
        return out;
    }

    static Object decodedBody(String kind, byte[] body) throws Exception {
        if (body == null) {
            return null;
        }
        switch (kind) {
            case "heartbeat":
                return new String(RemotingSerializable.decode(body, HeartbeatData.class).encode(), StandardCharsets.UTF_8);
            case "lock":
                return new String(RemotingSerializable.decode(body, LockBatchRequestBody.class).encode(), StandardCharsets.UTF_8);
            case "batch": {
                List<Object> items = new ArrayList<>();
                for (Message m : MessageDecoder.decodeMessages(ByteBuffer.wrap(body))) {
                    Map<String, Object> item = new LinkedHashMap<>();
                    item.put("flag", m.getFlag());
                    item.put("body", Base64.getEncoder().encodeToString(m.getBody()));
                    item.put("properties", m.getProperties());
                    items.add(item);
                }
                return items;
            }
            default:
                return null;
        }
    }

    static void decodeAll(JSONArray cases, String framesPath, String outPath) throws Exception {
        ByteBuffer all = ByteBuffer.wrap(Files.readAllBytes(Paths.get(framesPath)));
        StringBuilder out = new StringBuilder();
        for (int i = 0; i < cases.size(); i++) {
            JSONObject c = cases.getJSONObject(i);
            int length = all.getInt();
            byte[] frame = new byte[length];
            all.get(frame);
            RemotingCommand cmd = RemotingCommand.decode(ByteBuffer.wrap(frame));
            Map<String, Object> line = new LinkedHashMap<>();
            line.put("case", i);
            line.put("code", cmd.getCode());
            line.put("language", cmd.getLanguage().name());
            line.put("version", cmd.getVersion());
            line.put("opaque", cmd.getOpaque());
            line.put("flag", cmd.getFlag());
            line.put("remark", cmd.getRemark());
            line.put("serialize", cmd.getSerializeTypeCurrentRPC().name());
            line.put("extFields", cmd.getExtFields());
            byte[] body = cmd.getBody();
            line.put("bodyLength", body == null ? 0 : body.length);
            line.put("bodySha256", sha256(body == null ? new byte[0] : body));
            JSONObject hspec = c.getJSONObject("header");
            if (hspec != null) {
                @SuppressWarnings("unchecked")
                Class<? extends CommandCustomHeader> cls =
                    (Class<? extends CommandCustomHeader>) headerClass(hspec.getString("class"));
                line.put("header", headerFields(cmd.decodeCommandCustomHeader(cls)));
            }
            line.put("body", decodedBody(c.getJSONObject("body").getString("kind"), body));
            out.append(JSON.toJSONString(line, SerializerFeature.WriteMapNullValue)).append('\n');
        }
        if (all.hasRemaining()) {
            throw new IllegalStateException(all.remaining() + " bytes left after the last frame");
        }
        Files.write(Paths.get(outPath), out.toString().getBytes(StandardCharsets.UTF_8));
    }

    // ------------------------------------------------------------------ stored messages

    static InetSocketAddress address(String host, int port) throws Exception {
        return new InetSocketAddress(InetAddress.getByName(host), port);
    }

    static int hostFlags(InetSocketAddress born, InetSocketAddress store) {
        int flags = 0;
        if (born.getAddress().getAddress().length == 16) {
            flags |= MessageSysFlag.BORNHOST_V6_FLAG;
        }
        if (store.getAddress().getAddress().length == 16) {
            flags |= MessageSysFlag.STOREHOSTADDRESS_V6_FLAG;
        }
        return flags;
    }

    static byte[] encodeStored(JSONObject m) throws Exception {
        byte[] body = Base64.getDecoder().decode(m.getString("body"));
        InetSocketAddress born = address(m.getString("bornHost"), m.getIntValue("bornPort"));
        InetSocketAddress store = address(m.getString("storeHost"), m.getIntValue("storePort"));
        int sysFlag = m.getIntValue("sysFlag") | hostFlags(born, store);
        String compress = m.getString("compress");
        if (compress != null) {
            // As the producer does before sending: compress (level 5) and flag the type.
            CompressionType type = CompressionType.of(compress);
            body = CompressorFactory.getCompressor(type).compress(body, 5);
            sysFlag |= MessageSysFlag.COMPRESSED_FLAG;
            if (m.getBooleanValue("typeBits")) {
                sysFlag |= type.getCompressionFlag();
            }
        }
        JSONArray props = m.getJSONArray("props");
        String encoder = m.getString("encoder");
        if ("decoder".equals(encoder)) {
            MessageExt ext = new MessageExt();
            ext.setTopic(m.getString("topic"));
            ext.setBody(body);
            ext.setQueueId(m.getIntValue("queueId"));
            ext.setFlag(m.getIntValue("flag"));
            ext.setQueueOffset(m.getLongValue("queueOffset"));
            ext.setCommitLogOffset(m.getLongValue("commitLogOffset"));
            ext.setSysFlag(sysFlag);
            ext.setBornTimestamp(m.getLongValue("bornTimestamp"));
            ext.setBornHost(born);
            ext.setStoreTimestamp(m.getLongValue("storeTimestamp"));
            ext.setStoreHost(store);
            ext.setReconsumeTimes(m.getIntValue("reconsumeTimes"));
            ext.setPreparedTransactionOffset(m.getLongValue("preparedTransactionOffset"));
            ext.setBodyCRC(UtilAll.crc32(body));
            for (int i = 0; i < props.size(); i++) {
                JSONArray kv = props.getJSONArray(i);
                MessageAccessor.putProperty(ext, kv.getString(0), kv.getString(1));
            }
            return MessageDecoder.encode(ext, false);
        }
        // The broker's path: the store's encoder, then the commit-log append writes the offset.
        MessageExtBrokerInner inner = new MessageExtBrokerInner();
        inner.setTopic(m.getString("topic"));
        inner.setBody(body);
        inner.setQueueId(m.getIntValue("queueId"));
        inner.setFlag(m.getIntValue("flag"));
        inner.setQueueOffset(m.getLongValue("queueOffset"));
        inner.setSysFlag(sysFlag);
        inner.setBornTimestamp(m.getLongValue("bornTimestamp"));
        inner.setBornHost(born);
        inner.setStoreTimestamp(m.getLongValue("storeTimestamp"));
        inner.setStoreHost(store);
        inner.setReconsumeTimes(m.getIntValue("reconsumeTimes"));
        inner.setPreparedTransactionOffset(m.getLongValue("preparedTransactionOffset"));
        inner.setBodyCRC(UtilAll.crc32(body));
        for (int i = 0; i < props.size(); i++) {
            JSONArray kv = props.getJSONArray(i);
            MessageAccessor.putProperty(inner, kv.getString(0), kv.getString(1));
        }
        inner.setPropertiesString(MessageDecoder.messageProperties2String(inner.getProperties()));
        if (m.getIntValue("version") == 2) {
            inner.setVersion(MessageVersion.MESSAGE_VERSION_V2);
        }
        MessageExtEncoder enc = new MessageExtEncoder(new MessageStoreConfig());
        if (enc.encode(inner) != null) {
            throw new IllegalStateException("store encoder refused the message");
        }
        ByteBuffer buf = enc.getEncoderBuffer();
        int size = buf.getInt(0);
        byte[] record = new byte[size];
        buf.get(record);
        // 7 PHYSICALOFFSET, filled in by the commit-log append
        ByteBuffer.wrap(record).putLong(28, m.getLongValue("commitLogOffset"));
        return record;
    }

    static Map<String, Object> storedView(MessageExt m) {
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("storeSize", m.getStoreSize());
        out.put("bodyCRC", m.getBodyCRC());
        out.put("queueId", m.getQueueId());
        out.put("flag", m.getFlag());
        out.put("queueOffset", m.getQueueOffset());
        out.put("commitLogOffset", m.getCommitLogOffset());
        out.put("sysFlag", m.getSysFlag());
        out.put("bornTimestamp", m.getBornTimestamp());
        InetSocketAddress born = (InetSocketAddress) m.getBornHost();
        out.put("bornHost", born.getAddress().getHostAddress());
        out.put("bornPort", born.getPort());
        out.put("storeTimestamp", m.getStoreTimestamp());
        InetSocketAddress store = (InetSocketAddress) m.getStoreHost();
        out.put("storeHost", store.getAddress().getHostAddress());
        out.put("storePort", store.getPort());
        out.put("reconsumeTimes", m.getReconsumeTimes());
        out.put("preparedTransactionOffset", m.getPreparedTransactionOffset());
        byte[] body = m.getBody();
        out.put("body", Base64.getEncoder().encodeToString(body == null ? new byte[0] : body));
        out.put("topic", m.getTopic());
        out.put("properties", m.getProperties());
        out.put("tags", m.getTags());
        out.put("keys", m.getKeys());
        out.put("msgId", m.getMsgId());
        out.put("offsetMsgId", ((MessageClientExt) m).getOffsetMsgId());
        return out;
    }

    static void messagesAll(JSONArray cases, String recordsPath, String outPath) throws Exception {
        ByteBuf all = Unpooled.buffer();
        for (int i = 0; i < cases.size(); i++) {
            all.writeBytes(encodeStored(cases.getJSONObject(i)));
        }
        byte[] bytes = new byte[all.readableBytes()];
        all.readBytes(bytes);
        Files.write(Paths.get(recordsPath), bytes);
        // What the Java client makes of those bytes (PullAPIWrapper: decodesBatch(client, decompress)).
        List<MessageExt> decoded = MessageDecoder.decodesBatch(ByteBuffer.wrap(bytes), true, true, true);
        if (decoded.size() != cases.size()) {
            throw new IllegalStateException("Java decoded " + decoded.size() + " of " + cases.size() + " records");
        }
        StringBuilder out = new StringBuilder();
        for (MessageExt m : decoded) {
            out.append(JSON.toJSONString(storedView(m), SerializerFeature.WriteMapNullValue)).append('\n');
        }
        Files.write(Paths.get(outPath), out.toString().getBytes(StandardCharsets.UTF_8));
    }
}
