// Key-group math for the lab: a line-by-line mirror of crates/keyshift-core/src/keygroup.rs (itself bit-for-bit
// Apache Flink's KeyGroupRangeAssignment and MathUtils.murmurHash). hack/lab-test.sh checks it in
// a browser against Flink's vectors (tests/data/flink_vectors.json) and against
// `keyshift plan -o json`. Plain script (no modules), so the page also works from file://.
"use strict";

(function (global) {
  const UPPER_BOUND_MAX_PARALLELISM = 1 << 15;
  const INT_MIN = -2147483648;

  /** Flink's MathUtils.bitMix, murmur3's 32-bit finaliser. */
  function bitMix(h) {
    h ^= h >>> 16;
    h = Math.imul(h, 0x85ebca6b);
    h ^= h >>> 13;
    h = Math.imul(h, 0xc2b2ae35);
    h ^= h >>> 16;
    return h | 0;
  }

  /** Flink's MathUtils.murmurHash(int): one murmur3 block and the finaliser, non-negative. */
  function murmurHash(code) {
    let h = code | 0;
    h = Math.imul(h, 0xcc9e2d51);
    h = (h << 15) | (h >>> 17);
    h = Math.imul(h, 0x1b873593);
    h = (h << 13) | (h >>> 19);
    h = (Math.imul(h, 5) + 0xe6546b64) | 0;
    h ^= 4;
    h = bitMix(h);
    if (h >= 0) return h;
    if (h !== INT_MIN) return -h;
    return 0;
  }

  /** Java's String.hashCode(): h = 31*h + c over the UTF-16 code units (a JS string's units). */
  function javaStringHash(s) {
    let h = 0;
    for (let i = 0; i < s.length; i++) h = (Math.imul(h, 31) + s.charCodeAt(i)) | 0;
    return h;
  }

  /** Java's Long.hashCode(): (int)(v ^ (v >>> 32)), for a BigInt in the long range. */
  function javaLongHash(v) {
    const u = BigInt.asUintN(64, v);
    return Number(BigInt.asIntN(32, u ^ (u >> 32n)));
  }

  /** Java's Integer.hashCode(): the value itself. */
  function javaIntHash(v) {
    return v | 0;
  }

  /** Reads a key typed as text like `keyshift keygroup --key-type T` does (Key::parse). */
  function parseKey(text, type) {
    if (type === "string") return { ok: true, hash: javaStringHash(text), key: text };
    const bits = type === "long" ? 64n : 32n;
    const t = text.trim();
    const fail = (reason) => ({
      ok: false,
      error: `key ${JSON.stringify(text)} is not a valid ${type} key: ${reason}`,
    });
    if (t === "") return fail("cannot parse integer from empty string");
    if (!/^[+-]?[0-9]+$/.test(t)) return fail("invalid digit found in string");
    const v = BigInt(t);
    const max = (1n << (bits - 1n)) - 1n;
    if (v > max) return fail("number too large to fit in target type");
    if (v < -max - 1n) return fail("number too small to fit in target type");
    const hash = type === "long" ? javaLongHash(v) : javaIntHash(Number(v));
    return { ok: true, hash, key: v.toString() };
  }

  /** Flink's computeKeyGroupForKeyHash: murmur(hash) % maxParallelism. */
  function keyGroupForHash(hash, maxParallelism) {
    return murmurHash(hash) % maxParallelism;
  }

  /** Checks 1 <= p <= G <= 32768; the messages are BoundsError's. Returns null when valid. */
  function boundsError(p, g) {
    if (g < 1)
      return `max parallelism must be at least 1 (got ${g}): set it to the key-group count, between 1 and ${UPPER_BOUND_MAX_PARALLELISM}`;
    if (g > UPPER_BOUND_MAX_PARALLELISM)
      return `max parallelism ${g} is above the upper bound ${UPPER_BOUND_MAX_PARALLELISM}: choose a key-group count between 1 and ${UPPER_BOUND_MAX_PARALLELISM}`;
    if (p < 1)
      return `parallelism must be at least 1 (got ${p}): set it to the number of parallel subtasks, 1 or more`;
    if (p > g)
      return `parallelism ${p} exceeds the key-group ceiling (max parallelism) ${g}: lower the parallelism to at most ${g}, or use a larger max parallelism`;
    return null;
  }

  /** Flink's computeOperatorIndexForKeyGroup: group * p / G (products stay below 2^31). */
  function owner(p, g, group) {
    return Math.floor((group * p) / g);
  }

  /** Flink's computeKeyGroupRangeForOperatorIndex: subtask i owns ceil(i*G/p) .. floor(((i+1)*G-1)/p). */
  function range(p, g, i) {
    return { start: Math.floor((i * g + p - 1) / p), end: Math.floor(((i + 1) * g - 1) / p) };
  }

  function ranges(p, g) {
    const out = [];
    for (let i = 0; i < p; i++) out.push(range(p, g, i));
    return out;
  }

  function nearestDivisors(g, p) {
    let below = 1;
    for (let d = Math.min(p, g); d >= 1; d--) {
      if (g % d === 0) {
        below = d;
        break;
      }
    }
    let above = g;
    for (let d = Math.max(p, 1); d <= g; d++) {
      if (g % d === 0) {
        above = d;
        break;
      }
    }
    return [below, above];
  }

  const plural = (n) => (n === 1 ? "" : "s");
  /** The verb's ending for a count as its subject: "1 owns", "2 own". */
  const verbS = (n) => (n === 1 ? "s" : "");

  /** Assignment::skew and Skew::summary. */
  function skew(p, g) {
    const minGroups = Math.floor(g / p);
    const heavy = g % p;
    const maxGroups = heavy === 0 ? minGroups : minGroups + 1;
    const [below, above] = nearestDivisors(g, p);
    const s = {
      maxParallelism: g,
      parallelism: p,
      minGroups,
      maxGroups,
      busiestSubtasks: heavy === 0 ? p : heavy,
      lightestSubtasks: heavy === 0 ? p : p - heavy,
      ratio: maxGroups / minGroups,
      divides: heavy === 0,
      divisorBelow: below,
      divisorAbove: above,
    };
    s.summary = s.divides
      ? `${p} divides ${g} evenly: every subtask owns ${minGroups} group${plural(minGroups)} (no skew)`
      : `${s.busiestSubtasks} subtask${plural(s.busiestSubtasks)} own${verbS(s.busiestSubtasks)} ${maxGroups} group${plural(maxGroups)} ` +
        `and ${s.lightestSubtasks} own${verbS(s.lightestSubtasks)} ${minGroups}: the busiest carries ${s.ratio.toFixed(2)}x the lightest; ` +
        `divisors of ${g} near ${p}: ${below}, ${above}`;
    return s;
  }

  /** keygroup::rescale_plan: who reads what, the one-to-one pairing, the groups that move. */
  function rescalePlan(fromP, toP, g) {
    const old = ranges(fromP, g);
    const neu = ranges(toP, g);
    const reads = neu.map(() => []);
    let i = 0;
    let j = 0;
    while (i < old.length && j < neu.length) {
      const start = Math.max(old[i].start, neu[j].start);
      const end = Math.min(old[i].end, neu[j].end);
      if (start <= end) reads[j].push({ from: i, start, end, count: end - start + 1 });
      if (old[i].end <= neu[j].end) i++;
      else j++;
    }
    const candidates = [];
    reads.forEach((rs, n) => rs.forEach((r) => candidates.push([r.count, n, r.from])));
    candidates.sort((a, b) => b[0] - a[0] || a[1] - b[1] || a[2] - b[2]);
    const paired = neu.map(() => null);
    const oldTaken = old.map(() => false);
    for (const [count, n, o] of candidates) {
      if (paired[n] === null && !oldTaken[o]) {
        paired[n] = { from: o, kept: count };
        oldTaken[o] = true;
      }
    }
    const subtasks = neu.map((r, index) => ({
      index,
      start: r.start,
      end: r.end,
      reads: reads[index],
      pairedWith: paired[index] === null ? null : paired[index].from,
      movedGroups: r.end - r.start + 1 - (paired[index] === null ? 0 : paired[index].kept),
    }));
    const movedGroups = subtasks.reduce((sum, s) => sum + s.movedGroups, 0);
    return { maxParallelism: g, fromParallelism: fromP, toParallelism: toP, subtasks, movedGroups, movedFraction: movedGroups / g };
  }

  global.KeyGroups = {
    UPPER_BOUND_MAX_PARALLELISM,
    murmurHash,
    javaStringHash,
    javaLongHash,
    javaIntHash,
    parseKey,
    keyGroupForHash,
    boundsError,
    owner,
    range,
    ranges,
    skew,
    rescalePlan,
  };
})(window);
