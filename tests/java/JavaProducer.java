import org.apache.rocketmq.client.producer.DefaultMQProducer;
import org.apache.rocketmq.client.producer.SendResult;
import org.apache.rocketmq.client.producer.SendStatus;
import org.apache.rocketmq.common.message.Message;

/**
 * Sends N messages with the Java DefaultMQProducer (defaults: bodies over 4 KiB are compressed).
 *
 * Arguments: namesrv topic count. Message i has tag "java-(i%3)", key "jk i", property idx=i and a
 * body of size sizes[i % sizes.length] whose byte j is (j*31+i) % 251.
 * Prints one line per message: "SENT queueId queueOffset msgId bodySize".
 */
public class JavaProducer {
    public static void main(String[] args) throws Exception {
        String namesrv = args[0];
        String topic = args[1];
        int count = Integer.parseInt(args[2]);
        int[] sizes = {1, 10, 1000, 4095, 4096, 5000, 20000, 100000};
        DefaultMQProducer producer = new DefaultMQProducer("java_oracle_producer_" + System.nanoTime());
        producer.setNamesrvAddr(namesrv);
        producer.setInstanceName("java-producer-" + System.nanoTime());
        producer.start();
        try {
            for (int i = 0; i < count; i++) {
                int size = sizes[i % sizes.length];
                byte[] body = new byte[size];
                for (int j = 0; j < size; j++) {
                    body[j] = (byte) ((j * 31 + i) % 251);
                }
                Message msg = new Message(topic, "java-" + (i % 3), "jk" + i, body);
                msg.putUserProperty("idx", Integer.toString(i));
                SendResult r = producer.send(msg);
                if (r.getSendStatus() != SendStatus.SEND_OK) {
                    throw new IllegalStateException("send failed: " + r);
                }
                System.out.println("SENT " + r.getMessageQueue().getQueueId() + " " + r.getQueueOffset()
                    + " " + r.getMsgId() + " " + size);
            }
        } finally {
            producer.shutdown();
        }
    }
}
