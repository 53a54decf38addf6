import java.security.MessageDigest;
import java.util.Random;

import org.apache.rocketmq.client.producer.DefaultMQProducer;
import org.apache.rocketmq.client.producer.SendResult;
import org.apache.rocketmq.client.producer.SendStatus;
import org.apache.rocketmq.common.compression.CompressionType;
import org.apache.rocketmq.common.message.Message;

/**
 * Sends bodies of 4 KiB to 200 KiB with the Java DefaultMQProducer compressing them with the
 * type given (ZLIB, LZ4 or ZSTD; compressMsgBodyOverHowmuch and compressLevel left at their
 * defaults, 4 KiB and 5).
 *
 * Arguments: namesrv topic compressTypes (comma-separated: each type in turn on one producer).
 * Each size is sent twice per type: random bytes (seeded) and compressible text. Prints one line
 * per message: "SENT type queueId queueOffset kind size sha256".
 */
public class JavaCompressProducer {
    public static void main(String[] args) throws Exception {
        String namesrv = args[0];
        String topic = args[1];
        int[] sizes = {4095, 4096, 4097, 20000, 65536, 150000, 204800};
        DefaultMQProducer producer = new DefaultMQProducer("java_compress_producer_" + System.nanoTime());
        producer.setNamesrvAddr(namesrv);
        producer.setInstanceName("java-compress-producer-" + System.nanoTime());
        producer.start();
        try {
            for (String typeName : args[2].split(",")) {
                CompressionType type = CompressionType.of(typeName);
                producer.setCompressType(type);
                Random random = new Random(type.getValue());
                for (int size : sizes) {
                    for (String kind : new String[]{"random", "text"}) {
                        byte[] body = new byte[size];
                        if (kind.equals("random")) {
                            random.nextBytes(body);
                        } else {
                            for (int j = 0; j < size; j++) {
                                body[j] = (byte) ("the quick brown fox " + (j / 97) % 13 + " jumps; ").charAt(j % 29);
                            }
                        }
                        Message msg = new Message(topic, kind, body);
                        SendResult r = producer.send(msg);
                        if (r.getSendStatus() != SendStatus.SEND_OK) {
                            throw new IllegalStateException("send failed: " + r);
                        }
                        StringBuilder hex = new StringBuilder();
                        for (byte b : MessageDigest.getInstance("SHA-256").digest(body)) {
                            hex.append(String.format("%02x", b));
                        }
                        System.out.println("SENT " + type + " " + r.getMessageQueue().getQueueId() + " "
                            + r.getQueueOffset() + " " + kind + " " + size + " " + hex);
                    }
                }
            }
        } finally {
            producer.shutdown();
        }
    }
}
