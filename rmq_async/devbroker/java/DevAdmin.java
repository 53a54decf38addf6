import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.io.OutputStreamWriter;
import java.io.PrintWriter;
import java.lang.reflect.InvocationTargetException;
import java.lang.reflect.Method;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;

import org.apache.rocketmq.acl.common.AclClientRPCHook;
import org.apache.rocketmq.acl.common.SessionCredentials;
import org.apache.rocketmq.client.exception.MQBrokerException;
import org.apache.rocketmq.client.exception.MQClientException;
import org.apache.rocketmq.common.TopicConfig;
import org.apache.rocketmq.remoting.RPCHook;
import org.apache.rocketmq.tools.admin.DefaultMQAdminExt;

/**
 * A resident admin client for the local development broker, so that creating a topic costs a
 * round trip instead of a JVM start.
 *
 * Usage: DevAdmin namesrvAddr [accessKey], with the environment variables RMQ_DEVADMIN_TOKEN
 * and (with an access key) RMQ_DEVADMIN_SECRET, the access key's secret.
 *
 * Listens on an ephemeral loopback port and prints "DEVADMIN PORT n" once ready. Each
 * connection carries one request line of tab-separated words, the first of them the token,
 * and gets back "OK" or "ERR message", then result lines, then the connection closes.
 *
 *   ping
 *   brokers CLUSTER              lines: brokerName TAB brokerId TAB address
 *   register BROKER_ADDR         asks the broker to register in the name server now
 *   create CLUSTER TOPIC QUEUES ORDER   creates/updates the topic on every master; lines: address
 *   route TOPIC                  "NOROUTE", or lines: brokerName TAB read TAB write TAB perm
 *   user ADDR NAME PASSWORD TYPE creates (or updates) an authentication user; TYPE Super|Normal
 *   acl ADDR SUBJECT RESOURCES ACTIONS DECISION   grants (comma-separated resources/actions)
 *   producers GROUP TOPIC        lines: the client ids a broker of TOPIC has for producer GROUP
 *
 * Exits when its standard input ends.
 *
 * The same source compiles against the 4.9.x, 5.1.x and 5.3.x jars: the route and cluster
 * classes moved package between 4.x and 5.x, so they are only ever named through {@code var};
 * the user and ACL calls exist from 5.3 on and are looked up by reflection.
 */
public class DevAdmin {
    private static DefaultMQAdminExt admin;
    /** The first word of every request: only the process that started this helper knows it. */
    private static String token;

    public static void main(String[] args) throws Exception {
        RPCHook hook = null;
        if (args.length >= 2) {
            // The password comes through the environment, which other users cannot read
            // (a command line they can).
            hook = new AclClientRPCHook(new SessionCredentials(args[1],
                System.getenv("RMQ_DEVADMIN_SECRET")));
        }
        token = System.getenv("RMQ_DEVADMIN_TOKEN");
        admin = new DefaultMQAdminExt(hook, 5000);
        admin.setNamesrvAddr(args[0]);
        admin.setInstanceName("devadmin-" + ProcessHandle.current().pid());
        admin.start();

        ServerSocket server = new ServerSocket(0, 50, InetAddress.getByName("127.0.0.1"));
        ExecutorService pool = Executors.newCachedThreadPool(r -> {
            Thread t = new Thread(r, "devadmin-conn");
            t.setDaemon(true);
            return t;
        });
        Thread acceptor = new Thread(() -> {
            while (true) {
                try {
                    Socket s = server.accept();
                    pool.execute(() -> serve(s));
                } catch (Exception e) {
                    return;
                }
            }
        }, "devadmin-accept");
        acceptor.setDaemon(true);
        acceptor.start();
        System.out.println("DEVADMIN PORT " + server.getLocalPort());
        System.out.flush();

        // Stay up until the parent closes our stdin.
        while (System.in.read() >= 0) {
            // discard
        }
        server.close();
        admin.shutdown();
        System.exit(0);
    }

    private static void serve(Socket socket) {
        try (Socket s = socket;
             BufferedReader in = new BufferedReader(
                 new InputStreamReader(s.getInputStream(), StandardCharsets.UTF_8));
             PrintWriter out = new PrintWriter(
                 new OutputStreamWriter(s.getOutputStream(), StandardCharsets.UTF_8))) {
            String line = in.readLine();
            List<String> result = new ArrayList<>();
            String status;
            String[] words = line == null ? new String[0] : line.split("\t");
            try {
                if (token == null || words.length == 0 || !MessageDigest.isEqual(
                        token.getBytes(StandardCharsets.UTF_8),
                        words[0].getBytes(StandardCharsets.UTF_8))) {
                    status = "ERR not this helper's client";
                } else {
                    status = handle(java.util.Arrays.copyOfRange(words, 1, words.length), result);
                }
            } catch (Exception e) {
                status = "ERR " + oneLine(e);
            }
            out.print(status + "\n");
            for (String r : result) {
                out.print(r + "\n");
            }
            out.flush();
        } catch (Exception e) {
            // the caller went away; nothing to report to
        }
    }

    private static String oneLine(Throwable e) {
        StringBuilder sb = new StringBuilder(e.getClass().getSimpleName());
        for (Throwable c = e; c != null; c = c.getCause()) {
            sb.append(": ").append(String.valueOf(c.getMessage()));
        }
        return sb.toString().replace('\n', ' ').replace('\r', ' ');
    }

    /**
     * Calls the admin method {@code name} taking {@code args.length} arguments (the user and ACL
     * API of 5.3, absent from older jars). A failure inside the call comes out as
     * InvocationTargetException; a missing method as an error naming the version gap.
     */
    private static Object invoke(String name, Object... args) throws Exception {
        for (Method m : admin.getClass().getMethods()) {
            if (m.getName().equals(name) && m.getParameterCount() == args.length) {
                return m.invoke(admin, args);
            }
        }
        throw new UnsupportedOperationException(
            name + " needs RocketMQ 5.3 or newer (authentication and authorization)");
    }

    private static List<String[]> brokers(String cluster) throws Exception {
        var info = admin.examineBrokerClusterInfo();
        List<String[]> rows = new ArrayList<>();
        if (info == null || info.getClusterAddrTable() == null) {
            return rows;
        }
        java.util.Set<String> names = info.getClusterAddrTable().get(cluster);
        if (names == null) {
            return rows;
        }
        for (String name : names) {
            var data = info.getBrokerAddrTable().get(name);
            if (data == null) {
                continue;
            }
            for (Map.Entry<Long, String> e : data.getBrokerAddrs().entrySet()) {
                rows.add(new String[] {name, String.valueOf(e.getKey()), e.getValue()});
            }
        }
        return rows;
    }

    private static String handle(String[] w, List<String> result) throws Exception {
        if (w.length == 0) {
            return "ERR empty request";
        }
        switch (w[0]) {
            case "ping":
                return "OK";
            case "brokers": {
                for (String[] row : brokers(w[1])) {
                    result.add(String.join("\t", row));
                }
                return "OK";
            }
            case "register": {
                Properties p = new Properties();
                p.setProperty("brokerPermission", "6");
                admin.updateBrokerConfig(w[1], p);
                return "OK";
            }
            case "create": {
                String cluster = w[1];
                String topic = w[2];
                int queues = Integer.parseInt(w[3]);
                boolean order = Boolean.parseBoolean(w[4]);
                TopicConfig config = new TopicConfig(topic);
                config.setReadQueueNums(queues);
                config.setWriteQueueNums(queues);
                config.setOrder(order);
                StringBuilder orderConf = new StringBuilder();
                for (String[] row : brokers(cluster)) {
                    if (!"0".equals(row[1])) {
                        continue;
                    }
                    admin.createAndUpdateTopicConfig(row[2], config);
                    result.add(row[2]);
                    if (orderConf.length() > 0) {
                        orderConf.append(';');
                    }
                    orderConf.append(row[0]).append(':').append(queues);
                }
                if (result.isEmpty()) {
                    return "ERR no master broker in cluster " + cluster;
                }
                if (order) {
                    admin.createOrUpdateOrderConf(topic, orderConf.toString(), true);
                }
                return "OK";
            }
            case "route": {
                try {
                    var route = admin.examineTopicRouteInfo(w[1]);
                    for (var q : route.getQueueDatas()) {
                        result.add(q.getBrokerName() + "\t" + q.getReadQueueNums() + "\t"
                            + q.getWriteQueueNums() + "\t" + q.getPerm());
                    }
                } catch (MQClientException e) {
                    if (e.getResponseCode() == 17) {
                        return "NOROUTE";
                    }
                    throw e;
                }
                return "OK";
            }
            case "user": {
                try {
                    invoke("createUser", (Object) w[1], w[2], w[3], w[4]);
                } catch (InvocationTargetException exists) {
                    invoke("updateUser", (Object) w[1], w[2], w[3], w[4], "enable");
                }
                return "OK";
            }
            case "acl": {
                List<String> resources = java.util.Arrays.asList(w[3].split(","));
                List<String> actions = java.util.Arrays.asList(w[4].split(","));
                invoke("createAcl", w[1], w[2], resources, actions, null, w[5]);
                return "OK";
            }
            case "producers": {
                try {
                    for (var c : admin.examineProducerConnectionInfo(w[1], w[2]).getConnectionSet()) {
                        result.add(c.getClientId());
                    }
                } catch (MQBrokerException none) {
                    // the broker answers an error when the group has no producer connected
                }
                return "OK";
            }
            default:
                return "ERR unknown request " + w[0];
        }
    }
}
