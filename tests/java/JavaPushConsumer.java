import java.util.List;

import org.apache.rocketmq.client.consumer.DefaultMQPushConsumer;
import org.apache.rocketmq.client.consumer.listener.ConsumeConcurrentlyStatus;
import org.apache.rocketmq.client.consumer.listener.MessageListenerConcurrently;
import org.apache.rocketmq.common.consumer.ConsumeFromWhere;
import org.apache.rocketmq.common.message.MessageExt;

/**
 * A plain Java DefaultMQPushConsumer used by the tests as the reference behaviour.
 *
 * Arguments: namesrv group topic instanceName consumeFromWhere [consumeTimestamp].
 * Prints "READY" once started, then one line per message: "MSG queueId queueOffset msgId",
 * and every half second the queues this client holds: "ASSIGNED id id ..." and
 * "HELD brokerName:id ...".
 * Stops when its standard input closes.
 */
public class JavaPushConsumer {
    public static void main(String[] args) throws Exception {
        String namesrv = args[0];
        String group = args[1];
        String topic = args[2];
        String instance = args[3];
        String fromWhere = args[4];
        DefaultMQPushConsumer consumer = new DefaultMQPushConsumer(group);
        consumer.setNamesrvAddr(namesrv);
        consumer.setInstanceName(instance);
        consumer.setConsumeFromWhere(ConsumeFromWhere.valueOf(fromWhere));
        if (args.length > 5) {
            consumer.setConsumeTimestamp(args[5]);
        }
        consumer.subscribe(topic, "*");
        consumer.registerMessageListener((MessageListenerConcurrently) (msgs, ctx) -> {
            StringBuilder sb = new StringBuilder();
            for (MessageExt m : msgs) {
                sb.append("MSG ").append(m.getQueueId()).append(' ').append(m.getQueueOffset())
                    .append(' ').append(m.getMsgId()).append('\n');
            }
            synchronized (System.out) {
                System.out.print(sb);
                System.out.flush();
            }
            return ConsumeConcurrentlyStatus.CONSUME_SUCCESS;
        });
        consumer.start();
        synchronized (System.out) {
            System.out.println("READY " + consumer.getDefaultMQPushConsumerImpl().getmQClientFactory().getClientId());
            System.out.flush();
        }
        Thread reporter = new Thread(() -> {
            while (true) {
                try {
                    Thread.sleep(500);
                } catch (InterruptedException e) {
                    return;
                }
                StringBuilder sb = new StringBuilder("ASSIGNED");
                consumer.getDefaultMQPushConsumerImpl().getRebalanceImpl().getProcessQueueTable().keySet()
                    .stream().filter(mq -> mq.getTopic().equals(topic))
                    .forEach(mq -> sb.append(' ').append(mq.getQueueId()));
                // The same queues with their broker names (several broker groups).
                StringBuilder named = new StringBuilder("HELD");
                consumer.getDefaultMQPushConsumerImpl().getRebalanceImpl().getProcessQueueTable().keySet()
                    .stream().filter(mq -> mq.getTopic().equals(topic))
                    .forEach(mq -> named.append(' ').append(mq.getBrokerName()).append(':')
                        .append(mq.getQueueId()));
                synchronized (System.out) {
                    System.out.println(sb);
                    System.out.println(named);
                    System.out.flush();
                }
            }
        });
        reporter.setDaemon(true);
        reporter.start();
        while (System.in.read() != -1) {
            // wait for the test to close our standard input
        }
        consumer.shutdown();
        System.out.println("STOPPED");
        System.out.flush();
    }
}
