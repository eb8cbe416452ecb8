// Generates reference test vectors for Flink's key-group math using the real
// Apache Flink classes. Run via hack/flink-vectors.sh; prints one JSON document
// (UTF-8) to stdout. Output is fully deterministic (fixed-seed java.util.Random).

import java.io.OutputStreamWriter;
import java.io.PrintWriter;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Random;
import java.util.TreeSet;

import org.apache.flink.runtime.state.KeyGroupRange;
import org.apache.flink.runtime.state.KeyGroupRangeAssignment;
import org.apache.flink.util.MathUtils;

public final class FlinkVectors {

    private static final int[] MAX_PARALLELISMS = {1, 7, 10, 128, 1000, 1024, 32768};

    private static final int[][] GP_PAIRS = {
        {128, 100}, {128, 3}, {128, 7}, {10, 10}, {32768, 1}, {32768, 32768}, {1024, 200}, {1000, 7},
    };

    /** Enumerate everything up to this size; above it, take a deterministic sample. */
    private static final int FULL_LIMIT = 1024;
    private static final int SAMPLE_SIZE = 200;

    private final StringBuilder out = new StringBuilder();

    public static void main(String[] args) throws Exception {
        String version = args.length > 0 ? args[0] : "unknown";
        FlinkVectors v = new FlinkVectors();
        String json = v.build(version);
        PrintWriter w = new PrintWriter(new OutputStreamWriter(System.out, StandardCharsets.UTF_8));
        w.print(json);
        w.flush();
    }

    private String build(String version) {
        out.append("{\n");
        out.append("  \"flinkVersion\": ").append(str(version)).append(",\n");
        out.append("  \"keyGroupRangeAssignment\": {\"DEFAULT_LOWER_BOUND_MAX_PARALLELISM\": ")
                .append(KeyGroupRangeAssignment.DEFAULT_LOWER_BOUND_MAX_PARALLELISM)
                .append(", \"UPPER_BOUND_MAX_PARALLELISM\": ")
                .append(KeyGroupRangeAssignment.UPPER_BOUND_MAX_PARALLELISM)
                .append("},\n");
        murmur();
        stringKeys();
        longKeys();
        intKeys();
        keyHashGroups();
        operatorIndex();
        ranges();
        defaultMaxParallelism();
        out.append("}\n");
        return out.toString();
    }

    // ---------------------------------------------------------------- murmur

    private static int[] murmurInputs() {
        List<Integer> in = new ArrayList<>(Arrays.asList(
                0, 1, -1, Integer.MIN_VALUE, Integer.MAX_VALUE, 42, 128, 2, 7, 255, 256, 65535, 65536,
                -42, -128, 0x7fff, 0x8000, 0x12345678, 0xdeadbeef, "hello".hashCode()));
        Random r = new Random(0x5EEDL);
        while (in.size() < 60) {
            in.add(r.nextInt());
        }
        return in.stream().mapToInt(Integer::intValue).toArray();
    }

    private void murmur() {
        List<String> rows = new ArrayList<>();
        for (int x : murmurInputs()) {
            rows.add("[" + x + ", " + MathUtils.murmurHash(x) + "]");
        }
        section("murmur", rows);
    }

    // ---------------------------------------------------------------- keys

    private static List<String> stringKeyList() {
        List<String> keys = new ArrayList<>(Arrays.asList("", "a", "hello", "Hello, World!"));
        for (int i = 1; i <= 50; i++) {
            keys.add("user-" + i);
        }
        keys.add("h\u00e9llo"); // héllo
        keys.add("\u65e5\u672c\u8a9e"); // 日本語
        keys.add("\ud83d\ude00x"); // U+1F600 GRINNING FACE + 'x' (surrogate pair)
        keys.add("a\ud83d\ude00\ud83c\udf89b"); // two supplementary chars
        StringBuilder longKey = new StringBuilder();
        for (int i = 0; i < 100; i++) {
            longKey.append((char) ('a' + (i % 26)));
        }
        keys.add(longKey.toString());
        return keys;
    }

    private void stringKeys() {
        List<String> rows = new ArrayList<>();
        for (String k : stringKeyList()) {
            for (int g : MAX_PARALLELISMS) {
                int kg = checkedAssign(k, g);
                rows.add("{\"key\": " + str(k) + ", \"maxParallelism\": " + g + ", \"keyGroup\": " + kg + "}");
            }
        }
        section("stringKeys", rows);
    }

    private void longKeys() {
        List<Long> keys = new ArrayList<>(Arrays.asList(
                0L, 1L, -1L, Long.MIN_VALUE, Long.MAX_VALUE, 1L << 32, 123456789012345L, 42L,
                (long) Integer.MAX_VALUE, (long) Integer.MIN_VALUE, 0xffffffffL, -(1L << 32)));
        Random r = new Random(0x10E6L);
        for (int i = 0; i < 20; i++) {
            keys.add(r.nextLong());
        }
        List<String> rows = new ArrayList<>();
        for (Long k : keys) {
            for (int g : MAX_PARALLELISMS) {
                int kg = checkedAssign(k, g);
                rows.add("{\"key\": " + k + ", \"maxParallelism\": " + g + ", \"keyGroup\": " + kg + "}");
            }
        }
        section("longKeys", rows);
    }

    private void intKeys() {
        List<Integer> keys = new ArrayList<>(Arrays.asList(
                0, 1, -1, Integer.MIN_VALUE, Integer.MAX_VALUE, 42, 128, 1000, -1000));
        Random r = new Random(0x1A7L);
        for (int i = 0; i < 20; i++) {
            keys.add(r.nextInt());
        }
        List<String> rows = new ArrayList<>();
        for (Integer k : keys) {
            for (int g : MAX_PARALLELISMS) {
                int kg = checkedAssign(k, g);
                rows.add("{\"key\": " + k + ", \"maxParallelism\": " + g + ", \"keyGroup\": " + kg + "}");
            }
        }
        section("intKeys", rows);
    }

    /** [keyHash, maxParallelism, keyGroup] via computeKeyGroupForKeyHash directly. */
    private void keyHashGroups() {
        List<String> rows = new ArrayList<>();
        for (int h : murmurInputs()) {
            for (int g : MAX_PARALLELISMS) {
                rows.add("[" + h + ", " + g + ", " + KeyGroupRangeAssignment.computeKeyGroupForKeyHash(h, g) + "]");
            }
        }
        section("keyHashGroups", rows);
    }

    private static int checkedAssign(Object key, int g) {
        int kg = KeyGroupRangeAssignment.assignToKeyGroup(key, g);
        int viaHash = KeyGroupRangeAssignment.computeKeyGroupForKeyHash(key.hashCode(), g);
        if (kg != viaHash || kg < 0 || kg >= g) {
            throw new IllegalStateException("inconsistent key group for " + key + " @ " + g);
        }
        return kg;
    }

    // ---------------------------------------------------------------- operators / ranges

    /** All of 0..n-1 if n <= FULL_LIMIT, else a deterministic sorted sample incl. 0 and n-1. */
    private static int[] indices(int n, long seed) {
        if (n <= FULL_LIMIT) {
            int[] all = new int[n];
            for (int i = 0; i < n; i++) {
                all[i] = i;
            }
            return all;
        }
        TreeSet<Integer> s = new TreeSet<>();
        s.add(0);
        s.add(n - 1);
        for (int i = 0; i < SAMPLE_SIZE / 2; i++) { // evenly spaced
            s.add((int) ((long) i * (n - 1) / (SAMPLE_SIZE / 2 - 1)));
        }
        Random r = new Random(seed);
        while (s.size() < SAMPLE_SIZE) {
            s.add(r.nextInt(n));
        }
        return s.stream().mapToInt(Integer::intValue).toArray();
    }

    private void operatorIndex() {
        List<String> rows = new ArrayList<>();
        for (int[] gp : GP_PAIRS) {
            int g = gp[0], p = gp[1];
            for (int kg : indices(g, 31L * g + p)) {
                int idx = KeyGroupRangeAssignment.computeOperatorIndexForKeyGroup(g, p, kg);
                rows.add("[" + g + ", " + p + ", " + kg + ", " + idx + "]");
            }
        }
        section("operatorIndex", rows);
    }

    private void ranges() {
        List<String> rows = new ArrayList<>();
        for (int[] gp : GP_PAIRS) {
            int g = gp[0], p = gp[1];
            for (int i : indices(p, 17L * g + p)) {
                KeyGroupRange r = KeyGroupRangeAssignment.computeKeyGroupRangeForOperatorIndex(g, p, i);
                rows.add("[" + g + ", " + p + ", " + i + ", " + r.getStartKeyGroup() + ", " + r.getEndKeyGroup() + "]");
            }
        }
        section("ranges", rows);
    }

    // ---------------------------------------------------------------- default max parallelism

    private void defaultMaxParallelism() {
        List<Integer> ps = new ArrayList<>();
        for (int p = 1; p <= 300; p++) {
            ps.add(p);
        }
        ps.addAll(Arrays.asList(1000, 10000, 21845, 21846, 30000, 32768, 100000));
        List<String> rows = new ArrayList<>();
        List<String> rejected = new ArrayList<>();
        for (int p : ps) {
            try {
                rows.add("[" + p + ", " + KeyGroupRangeAssignment.computeDefaultMaxParallelism(p) + "]");
            } catch (IllegalArgumentException e) {
                rejected.add("[" + p + ", " + str(e.getClass().getName()) + "]");
            }
        }
        section("defaultMaxParallelism", rows);
        // Inputs for which Flink throws (e.g. parallelism > UPPER_BOUND_MAX_PARALLELISM).
        sectionLast("defaultMaxParallelismRejected", rejected);
    }

    // ---------------------------------------------------------------- JSON helpers

    private void section(String name, List<String> rows) {
        writeSection(name, rows);
        out.append(",\n");
    }

    private void sectionLast(String name, List<String> rows) {
        writeSection(name, rows);
        out.append("\n");
    }

    private void writeSection(String name, List<String> rows) {
        out.append("  ").append(str(name)).append(": [");
        for (int i = 0; i < rows.size(); i++) {
            out.append(i == 0 ? "\n    " : ",\n    ").append(rows.get(i));
        }
        out.append(rows.isEmpty() ? "]" : "\n  ]");
    }

    /** JSON string literal; non-ASCII is emitted as raw UTF-8 (surrogate pairs kept intact). */
    private static String str(String s) {
        StringBuilder b = new StringBuilder("\"");
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            switch (c) {
                case '"': b.append("\\\""); break;
                case '\\': b.append("\\\\"); break;
                case '\n': b.append("\\n"); break;
                case '\r': b.append("\\r"); break;
                case '\t': b.append("\\t"); break;
                default:
                    if (c < 0x20) {
                        b.append(String.format("\\u%04x", (int) c));
                    } else {
                        b.append(c);
                    }
            }
        }
        return b.append('"').toString();
    }
}
