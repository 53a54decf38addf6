import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.Arrays;
import java.util.HashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicLongArray;

import org.apache.rocketmq.client.consumer.DefaultMQPushConsumer;
import org.apache.rocketmq.client.consumer.listener.ConsumeConcurrentlyStatus;
import org.apache.rocketmq.client.consumer.listener.MessageListenerConcurrently;
import org.apache.rocketmq.common.consumer.ConsumeFromWhere;
import org.apache.rocketmq.common.message.MessageExt;

/**
 * The Java contender of the rmq_async benchmark: a DefaultMQPushConsumer with a no-op listener.
 *
 * Arguments are key=value pairs: namesrv, group, topic, expected (messages to wait for),
 * queues (the topic's queue count), batch (consumeMessageBatchMaxSize, 0 keeps the default),
 * latency (true records born/store-to-listener latencies), timeout (seconds without progress
 * before giving up), clktck (kernel clock ticks per second, for /proc/self/stat), brokerpid
 * (optional: the broker's pid, whose CPU over the timed part is reported as broker_cpu).
 *
 * Prints, on standard output: "READY" once messages arrive (latency mode: once a probe message,
 * tagged "probe", has arrived from every queue; probes, and the warm-up messages tagged "warmup"
 * that follow them, are not counted), "PROGRESS n" four times a second, then one "RESULT {json}"
 * line. The listener only counts, marks each (queue, offset) in
 * a bitmap to detect duplicates, and in latency mode records two numbers per message.
 */
public class BenchConsumer {
    private static final int MAX_QUEUES = 1024;
    private static final String PROBE_TAG = "probe";
    private static final String WARMUP_TAG = "warmup";

    private final String topic;
    private final int expected;
    private final boolean latency;
    private final AtomicLong consumed = new AtomicLong();
    private final AtomicLong duplicates = new AtomicLong();
    private final AtomicLong bodyBytes = new AtomicLong();
    private final AtomicLong calls = new AtomicLong();
    private final AtomicLongArray[] seen = new AtomicLongArray[MAX_QUEUES];
    private final long[] b2c;
    private final long[] s2c;
    private final AtomicInteger samples = new AtomicInteger();
    private final Set<Integer> probeQueues = ConcurrentHashMap.newKeySet();
    private final CountDownLatch done = new CountDownLatch(1);
    private volatile long firstNanos;
    private volatile long endNanos;

    BenchConsumer(String topic, int expected, boolean latency) {
        this.topic = topic;
        this.expected = expected;
        this.latency = latency;
        this.b2c = latency ? new long[expected] : new long[0];
        this.s2c = latency ? new long[expected] : new long[0];
    }

    private AtomicLongArray bitmap(int queueId) {
        AtomicLongArray map = seen[queueId];
        if (map == null) {
            synchronized (seen) {
                map = seen[queueId];
                if (map == null) {
                    map = new AtomicLongArray(expected / 64 + 1);
                    seen[queueId] = map;
                }
            }
        }
        return map;
    }

    private void mark(int queueId, long offset) {
        AtomicLongArray map = bitmap(queueId);
        int word = (int) (offset >>> 6);
        if (word >= map.length()) {
            duplicates.incrementAndGet(); // beyond what was produced: not one of ours
            return;
        }
        long bit = 1L << (offset & 63);
        while (true) {
            long old = map.get(word);
            if ((old & bit) != 0) {
                duplicates.incrementAndGet();
                return;
            }
            if (map.compareAndSet(word, old, old | bit)) {
                return;
            }
        }
    }

    ConsumeConcurrentlyStatus onMessages(List<MessageExt> msgs) {
        long now = latency ? System.currentTimeMillis() : 0L;
        long bytes = 0;
        int n = 0;
        for (MessageExt m : msgs) {
            if (latency) {
                String tag = m.getTags();
                if (PROBE_TAG.equals(tag)) {
                    probeQueues.add(m.getQueueId());
                    continue;
                }
                if (WARMUP_TAG.equals(tag)) {
                    continue;
                }
            }
            n++;
            mark(m.getQueueId(), m.getQueueOffset());
            bytes += m.getBody() == null ? 0 : m.getBody().length;
            if (latency) {
                int i = samples.getAndIncrement();
                if (i < b2c.length) {
                    b2c[i] = now - m.getBornTimestamp();
                    s2c[i] = now - m.getStoreTimestamp();
                }
            }
        }
        bodyBytes.addAndGet(bytes);
        calls.incrementAndGet();
        if (n == 0) {
            return ConsumeConcurrentlyStatus.CONSUME_SUCCESS;
        }
        long before = consumed.getAndAdd(n);
        if (before == 0) {
            firstNanos = System.nanoTime();
        }
        if (before < expected && before + n >= expected) {
            endNanos = System.nanoTime();
            done.countDown();
        }
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS;
    }

    static long[] procTicks() throws Exception {
        return procTicks("self");
    }

    /** (utime, stime) clock ticks of a process, all its threads. */
    static long[] procTicks(String pid) throws Exception {
        String stat = new String(Files.readAllBytes(Paths.get("/proc/" + pid + "/stat")), StandardCharsets.US_ASCII);
        String[] f = stat.substring(stat.lastIndexOf(')') + 2).trim().split(" ");
        return new long[] {Long.parseLong(f[11]), Long.parseLong(f[12])};
    }

    /** The broker's CPU ticks, or null when its pid is not given or it cannot be read. */
    static long[] brokerTicks(String pid) {
        if (pid == null) {
            return null;
        }
        try {
            return procTicks(pid);
        } catch (Exception e) {
            return null;
        }
    }

    static long peakRssKib() throws Exception {
        for (String line : Files.readAllLines(Paths.get("/proc/self/status"), StandardCharsets.US_ASCII)) {
            if (line.startsWith("VmHWM:")) {
                return Long.parseLong(line.replaceAll("[^0-9]", ""));
            }
        }
        return -1;
    }

    static String percentiles(long[] values, int n) {
        if (n == 0) {
            return "null";
        }
        long[] v = Arrays.copyOf(values, n);
        Arrays.sort(v);
        double sum = 0;
        for (long x : v) {
            sum += x;
        }
        return String.format(Locale.ROOT,
            "{\"n\":%d,\"p50\":%d,\"p90\":%d,\"p99\":%d,\"p999\":%d,\"max\":%d,\"mean\":%.3f}",
            n, rank(v, 0.50), rank(v, 0.90), rank(v, 0.99), rank(v, 0.999), v[n - 1], sum / n);
    }

    static long rank(long[] sorted, double q) {
        int i = (int) Math.ceil(q * sorted.length) - 1;
        return sorted[Math.max(0, Math.min(sorted.length - 1, i))];
    }

    static void emit(String line) {
        synchronized (System.out) {
            System.out.println(line);
            System.out.flush();
        }
    }

    public static void main(String[] args) throws Exception {
        Map<String, String> a = new HashMap<>();
        for (String arg : args) {
            int eq = arg.indexOf('=');
            a.put(arg.substring(0, eq), arg.substring(eq + 1));
        }
        String topic = a.get("topic");
        int expected = Integer.parseInt(a.get("expected"));
        int queues = Integer.parseInt(a.getOrDefault("queues", "8"));
        int batch = Integer.parseInt(a.getOrDefault("batch", "0"));
        boolean latency = Boolean.parseBoolean(a.getOrDefault("latency", "false"));
        double timeout = Double.parseDouble(a.getOrDefault("timeout", "60"));
        double clkTck = Double.parseDouble(a.getOrDefault("clktck", "100"));
        String brokerPid = a.get("brokerpid");

        BenchConsumer bench = new BenchConsumer(topic, expected, latency);
        DefaultMQPushConsumer consumer = new DefaultMQPushConsumer(a.get("group"));
        consumer.setNamesrvAddr(a.get("namesrv"));
        consumer.setInstanceName("bench-" + ProcessHandle.current().pid());
        consumer.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET);
        if (batch > 0) {
            consumer.setConsumeMessageBatchMaxSize(batch);
        }
        consumer.subscribe(topic, "*");
        consumer.registerMessageListener(
            (MessageListenerConcurrently) (msgs, ctx) -> bench.onMessages(msgs));

        long[] broker0 = brokerTicks(brokerPid);
        long[] cpu0 = procTicks();
        long t0 = System.nanoTime();
        consumer.start();
        long readyNanos = 0;
        long lastCount = -1;
        long lastChange = System.nanoTime();
        long lastPrint = 0;
        boolean ok = true;
        String reason = "";
        while (!bench.done.await(50, TimeUnit.MILLISECONDS)) {
            long now = System.nanoTime();
            if (readyNanos == 0) {
                boolean ready = latency ? bench.probeQueues.size() >= queues : bench.consumed.get() > 0;
                if (ready) {
                    readyNanos = now;
                    emit("READY");
                }
            }
            long count = bench.consumed.get();
            if (count != lastCount) {
                lastCount = count;
                lastChange = now;
            } else if ((now - lastChange) / 1e9 > timeout) {
                ok = false;
                reason = "no progress for " + timeout + " s at " + count + " of " + expected;
                break;
            }
            if (now - lastPrint > 250_000_000L) {
                lastPrint = now;
                emit("PROGRESS " + count);
            }
        }
        long[] cpu1 = procTicks();
        long[] broker1 = brokerTicks(brokerPid);
        long end = ok ? bench.endNanos : System.nanoTime();
        // Give late duplicates a moment to show up before the verdict.
        Thread.sleep(300);
        long[] cpuTotal = procTicks();
        long count = bench.consumed.get();
        long dup = bench.duplicates.get();
        StringBuilder sb = new StringBuilder("RESULT {");
        sb.append("\"ok\":").append(ok).append(',');
        sb.append("\"reason\":\"").append(reason).append("\",");
        sb.append("\"consumed\":").append(count).append(',');
        sb.append("\"duplicates\":").append(dup).append(',');
        sb.append("\"body_bytes\":").append(bench.bodyBytes.get()).append(',');
        sb.append("\"listener_calls\":").append(bench.calls.get()).append(',');
        sb.append(String.format(Locale.ROOT, "\"seconds\":%.6f,", (end - t0) / 1e9));
        sb.append(String.format(Locale.ROOT, "\"first_message_seconds\":%.6f,",
            bench.firstNanos == 0 ? -1.0 : (bench.firstNanos - t0) / 1e9));
        sb.append(String.format(Locale.ROOT, "\"ready_seconds\":%.6f,",
            readyNanos == 0 ? -1.0 : (readyNanos - t0) / 1e9));
        sb.append(String.format(Locale.ROOT, "\"cpu_user\":%.3f,\"cpu_sys\":%.3f,",
            (cpu1[0] - cpu0[0]) / clkTck, (cpu1[1] - cpu0[1]) / clkTck));
        sb.append(String.format(Locale.ROOT, "\"cpu_user_total\":%.3f,\"cpu_sys_total\":%.3f,",
            cpuTotal[0] / clkTck, cpuTotal[1] / clkTck));
        if (broker0 != null && broker1 != null) {
            sb.append(String.format(Locale.ROOT, "\"broker_cpu\":%.3f,",
                (broker1[0] + broker1[1] - broker0[0] - broker0[1]) / clkTck));
        }
        sb.append("\"peak_rss_kib\":").append(peakRssKib()).append(',');
        sb.append("\"runtime\":\"").append(System.getProperty("java.vm.name")).append(' ')
            .append(System.getProperty("java.version")).append("\",");
        int n = Math.min(bench.samples.get(), bench.b2c.length);
        sb.append("\"latency_b2c_ms\":").append(percentiles(bench.b2c, n)).append(',');
        sb.append("\"latency_s2c_ms\":").append(percentiles(bench.s2c, n));
        sb.append('}');
        emit(sb.toString());
        consumer.shutdown();
        System.exit(0);
    }
}
