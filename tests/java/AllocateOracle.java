import java.io.BufferedReader;
import java.io.FileInputStream;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashSet;
import java.util.List;

import org.apache.rocketmq.client.consumer.AllocateMessageQueueStrategy;
import org.apache.rocketmq.client.consumer.rebalance.AllocateMachineRoomNearby;
import org.apache.rocketmq.client.consumer.rebalance.AllocateMessageQueueAveragely;
import org.apache.rocketmq.client.consumer.rebalance.AllocateMessageQueueAveragelyByCircle;
import org.apache.rocketmq.client.consumer.rebalance.AllocateMessageQueueByMachineRoom;
import org.apache.rocketmq.client.consumer.rebalance.AllocateMessageQueueConsistentHash;
import org.apache.rocketmq.common.message.MessageQueue;

/**
 * Runs the Java client's allocation strategies on cases read from a UTF-8 file (argument 1) and
 * prints what they return, for comparison with rmq_async.consumer.allocate.
 *
 * Input, one item per line, fields separated by TAB:
 *   CASE  strategy  parameter      (AVG | AVG_BY_CIRCLE | CONSISTENT_HASH v | MACHINE_ROOM rooms,
 *                                   comma separated | MACHINE_ROOM_NEARBY)
 *   MQ    topic  brokerName  queueId
 *   CID   clientId
 *   ASK   clientId                 (a client id to allocate for; may be absent from the CIDs)
 *   END
 * Output per case: "SORTMQ case i,j,..." and "SORTCID case i,j,..." (input positions in Java's
 * sorted order), then per ASK "ALLOC case ask i,j,..." (input positions of the allocated queues)
 * or "ERROR case ask ExceptionClass". Strategies get the lists in input order, unsorted.
 * MACHINE_ROOM_NEARBY wraps AVG; a room is the text before the first '-' of a broker name or
 * client id.
 */
public class AllocateOracle {
    static final class PrefixRooms implements AllocateMachineRoomNearby.MachineRoomResolver {
        public String brokerDeployIn(MessageQueue mq) {
            return prefix(mq.getBrokerName());
        }

        public String consumerDeployIn(String clientId) {
            return prefix(clientId);
        }

        private static String prefix(String s) {
            int dash = s.indexOf('-');
            return dash < 0 ? s : s.substring(0, dash);
        }
    }

    static String join(List<Integer> xs) {
        StringBuilder sb = new StringBuilder();
        for (int i = 0; i < xs.size(); i++) {
            if (i > 0) {
                sb.append(',');
            }
            sb.append(xs.get(i));
        }
        return sb.toString();
    }

    static AllocateMessageQueueStrategy strategy(String name, String param) {
        switch (name) {
            case "AVG":
                return new AllocateMessageQueueAveragely();
            case "AVG_BY_CIRCLE":
                return new AllocateMessageQueueAveragelyByCircle();
            case "CONSISTENT_HASH":
                return new AllocateMessageQueueConsistentHash(Integer.parseInt(param));
            case "MACHINE_ROOM": {
                AllocateMessageQueueByMachineRoom s = new AllocateMessageQueueByMachineRoom();
                s.setConsumeridcs(new HashSet<>(Arrays.asList(param.split(","))));
                return s;
            }
            case "MACHINE_ROOM_NEARBY":
                return new AllocateMachineRoomNearby(new AllocateMessageQueueAveragely(), new PrefixRooms());
            default:
                throw new IllegalArgumentException("unknown strategy " + name);
        }
    }

    public static void main(String[] args) throws Exception {
        BufferedReader in = new BufferedReader(
            new InputStreamReader(new FileInputStream(args[0]), StandardCharsets.UTF_8));
        int caseNo = -1;
        String name = null;
        String param = null;
        List<MessageQueue> mqs = new ArrayList<>();
        List<String> cids = new ArrayList<>();
        List<String> asks = new ArrayList<>();
        String line;
        while ((line = in.readLine()) != null) {
            String[] f = line.split("\t", -1);
            switch (f[0]) {
                case "CASE":
                    caseNo++;
                    name = f[1];
                    param = f.length > 2 ? f[2] : "";
                    mqs.clear();
                    cids.clear();
                    asks.clear();
                    break;
                case "MQ":
                    mqs.add(new MessageQueue(f[1], f[2], Integer.parseInt(f[3])));
                    break;
                case "CID":
                    cids.add(f[1]);
                    break;
                case "ASK":
                    asks.add(f[1]);
                    break;
                case "END": {
                    List<MessageQueue> sortedMqs = new ArrayList<>(mqs);
                    java.util.Collections.sort(sortedMqs);
                    List<Integer> mqOrder = new ArrayList<>();
                    for (MessageQueue mq : sortedMqs) {
                        mqOrder.add(mqs.indexOf(mq));
                    }
                    List<String> sortedCids = new ArrayList<>(cids);
                    java.util.Collections.sort(sortedCids);
                    List<Integer> cidOrder = new ArrayList<>();
                    for (String c : sortedCids) {
                        cidOrder.add(cids.indexOf(c));
                    }
                    System.out.println("SORTMQ " + caseNo + " " + join(mqOrder));
                    System.out.println("SORTCID " + caseNo + " " + join(cidOrder));
                    AllocateMessageQueueStrategy s = strategy(name, param);
                    for (int a = 0; a < asks.size(); a++) {
                        try {
                            List<MessageQueue> got = s.allocate("oracle_group", asks.get(a),
                                new ArrayList<>(mqs), new ArrayList<>(cids));
                            List<Integer> idx = new ArrayList<>();
                            for (MessageQueue mq : got) {
                                idx.add(mqs.indexOf(mq));
                            }
                            System.out.println("ALLOC " + caseNo + " " + a + " " + join(idx));
                        } catch (RuntimeException e) {
                            System.out.println("ERROR " + caseNo + " " + a + " " + e.getClass().getSimpleName());
                        }
                    }
                    break;
                }
                default:
                    throw new IllegalArgumentException("bad line: " + line);
            }
        }
        System.out.flush();
    }
}
