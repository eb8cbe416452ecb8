// The browser test of docs/lab/: headless Chromium opens the page from file:// and this script
// drives it over the DevTools protocol (through --remote-debugging-pipe: no port, no npm package,
// only Node's standard library). Run by hack/lab-test.sh; see there for the arguments.
//
//   node tests/lab/lab-test.mjs --chromium /usr/bin/chromium [--keyshift target/debug/keyshift]
//        [--screenshot out.png]
//
// Prints one line per check and closes with "lab: N passed, M failed"; exits 1 when any failed.

import { spawn, execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
const args = process.argv.slice(2);
const opt = (name) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : undefined;
};
const chromiumBin = opt("--chromium") || "/usr/bin/chromium";
const keyshiftBin = opt("--keyshift");
const screenshot = opt("--screenshot");
const pageUrl = pathToFileURL(join(root, "docs/lab/index.html")).href;

// ---- a minimal DevTools-protocol client over the pipe -------------------------------------------

const profile = mkdtempSync(join(tmpdir(), "keyshift-lab-chromium-"));
const chrome = spawn(
  chromiumBin,
  [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-background-timer-throttling",
    "--disable-renderer-backgrounding",
    "--disable-backgrounding-occluded-windows",
    "--allow-file-access-from-files",
    `--user-data-dir=${profile}`,
    "--remote-debugging-pipe",
    "about:blank",
  ],
  { stdio: ["ignore", "ignore", "pipe", "pipe", "pipe"] },
);
let chromeStderr = "";
chrome.stderr.on("data", (d) => (chromeStderr = (chromeStderr + d).slice(-4000)));
const toChrome = chrome.stdio[3];
const fromChrome = chrome.stdio[4];

let nextId = 1;
const pending = new Map();
const listeners = [];
let buffer = "";
fromChrome.on("data", (chunk) => {
  buffer += chunk.toString("utf8");
  let end;
  while ((end = buffer.indexOf("\0")) >= 0) {
    const msg = JSON.parse(buffer.slice(0, end));
    buffer = buffer.slice(end + 1);
    if (msg.id !== undefined && pending.has(msg.id)) {
      const { resolve: ok, reject, method } = pending.get(msg.id);
      pending.delete(msg.id);
      if (msg.error) reject(new Error(`${method}: ${msg.error.message}`));
      else ok(msg.result);
    } else if (msg.method) {
      for (const l of listeners) l(msg);
    }
  }
});

function send(method, params = {}, sessionId) {
  const id = nextId++;
  const msg = { id, method, params };
  if (sessionId) msg.sessionId = sessionId;
  return new Promise((ok, reject) => {
    pending.set(id, { resolve: ok, reject, method });
    toChrome.write(JSON.stringify(msg) + "\0");
  });
}

function waitFor(method, timeoutMs) {
  return new Promise((ok, reject) => {
    const timer = setTimeout(() => reject(new Error(`no ${method} within ${timeoutMs} ms`)), timeoutMs);
    const l = (msg) => {
      if (msg.method === method) {
        clearTimeout(timer);
        listeners.splice(listeners.indexOf(l), 1);
        ok(msg.params);
      }
    };
    listeners.push(l);
  });
}

const sleep = (ms) => new Promise((ok) => setTimeout(ok, ms));

// ---- the checks -----------------------------------------------------------------------------

const problems = []; // console errors, exceptions, requests that leave file://
listeners.push((msg) => {
  const p = msg.params || {};
  if (msg.method === "Runtime.exceptionThrown") {
    const d = p.exceptionDetails || {};
    problems.push(`exception: ${(d.exception && d.exception.description) || d.text}`);
  } else if (msg.method === "Runtime.consoleAPICalled" && ["error", "assert", "warning"].includes(p.type)) {
    problems.push(`console.${p.type}: ${p.args.map((a) => a.value ?? a.description).join(" ")}`);
  } else if (msg.method === "Log.entryAdded" && ["error", "warning"].includes(p.entry.level)) {
    problems.push(`log ${p.entry.level}: ${p.entry.text} ${p.entry.url || ""}`);
  } else if (msg.method === "Network.requestWillBeSent") {
    const url = p.request.url;
    if (!url.startsWith("file://") && !url.startsWith("data:")) problems.push(`network request: ${url}`);
  }
});

let session;

/** Evaluates an expression (a promise is awaited) in the page and returns its JSON value. */
async function page(expression) {
  const r = await send("Runtime.evaluate", { expression, awaitPromise: true, returnByValue: true }, session);
  if (r.exceptionDetails) {
    const d = r.exceptionDetails;
    throw new Error(`in the page: ${(d.exception && d.exception.description) || d.text}`);
  }
  return r.result.value;
}

/** Sets an input's value as typing would (an input event) and returns nothing. */
const set = (id, value) =>
  page(`(() => { const e = document.getElementById(${JSON.stringify(id)}); e.value = ${JSON.stringify(String(value))};
    e.dispatchEvent(new Event(e.tagName === "SELECT" ? "change" : "input", { bubbles: true })); })()`);
const text = (id) => page(`document.getElementById(${JSON.stringify(id)}).textContent`);
const click = (id) => page(`document.getElementById(${JSON.stringify(id)}).click()`);

/** JSON with object keys sorted, so equal values compare equal whatever their key order. */
function canonical(v) {
  if (Array.isArray(v)) return `[${v.map(canonical).join(",")}]`;
  if (v !== null && typeof v === "object")
    return `{${Object.keys(v).sort().map((k) => `${JSON.stringify(k)}:${canonical(v[k])}`).join(",")}}`;
  return JSON.stringify(v);
}

function assertEq(actual, expected, what) {
  const a = canonical(actual);
  const e = canonical(expected);
  if (a !== e) throw new Error(`${what}: got ${a}, expected ${e}`);
}

const checks = [];
const check = (name, fn) => checks.push({ name, fn });

check("ranges for G=128, p=3 as the owner formula gives them, with the skew", async () => {
  await set("groups", 128);
  await set("from", "");
  await set("parallelism", 3);
  const rows = await page(`[...document.querySelectorAll("#ranges tbody tr")].map((tr) =>
    [tr.cells[0].textContent, tr.cells[1].textContent, tr.cells[2].textContent])`);
  assertEq(rows, [["0", "0-42", "43"], ["1", "43-85", "43"], ["2", "86-127", "42"]], "rows");
  const rects = await page(`[...document.querySelectorAll("#strips rect.range")].map((r) =>
    [r.dataset.strip, r.dataset.start, r.dataset.end])`);
  assertEq(rects, [["new", "0", "42"], ["new", "43", "85"], ["new", "86", "127"]], "strip");
  assertEq(
    await text("skew"),
    "2 subtasks own 43 groups and 1 owns 42: the busiest carries 1.02x the lightest; divisors of 128 near 3: 2, 4",
    "skew",
  );
});

check("a rescale 4 -> 8 of 128 groups moves 64, marked on the strip", async () => {
  await set("groups", 128);
  await set("parallelism", 8);
  await set("from", 4);
  assertEq(await text("moved"), "64", "moved groups");
  const marked = await page(`[...document.querySelectorAll("#strips rect.moved")]
    .reduce((s, r) => s + Number(r.dataset.groups), 0)`);
  assertEq(marked, 64, "groups marked as moved");
  const strips = await page(`[...new Set([...document.querySelectorAll("#strips rect.range")].map((r) => r.dataset.strip))]`);
  assertEq(strips, ["old", "new"], "the old strip above the new one");
  assertEq(await text("skew"), "8 divides 128 evenly: every subtask owns 16 groups (no skew)", "skew");
});

check("a parallelism above G is refused with the CLI's message", async () => {
  await set("from", "");
  await set("parallelism", 200);
  const e = await text("bounds-error");
  if (!e.includes("exceeds the key-group ceiling (max parallelism) 128")) throw new Error(`message: ${e}`);
  assertEq(await page(`document.querySelectorAll("#ranges tbody tr").length`), 0, "rows while invalid");
  await set("parallelism", 8);
  assertEq(await text("bounds-error"), "", "message after a valid value");
});

const vectorsText = readFileSync(join(root, "tests/data/flink_vectors.json"), "utf8");
// Long keys go past 2^53: quote every numeric key so none is rounded by JSON.parse (the page reads
// keys as text, as the CLI does).
const vectors = JSON.parse(vectorsText.replace(/"key": (-?[0-9]+)/g, '"key": "$1"'));

check("murmur, owners and ranges equal Flink's vectors", async () => {
  const bad = await page(`(() => {
    const v = ${JSON.stringify({ murmur: vectors.murmur, keyHashGroups: vectors.keyHashGroups, operatorIndex: vectors.operatorIndex, ranges: vectors.ranges })};
    const bad = [];
    for (const [input, want] of v.murmur) if (KeyGroups.murmurHash(input) !== want) bad.push(["murmur", input, want]);
    for (const [hash, g, want] of v.keyHashGroups) if (KeyGroups.keyGroupForHash(hash, g) !== want) bad.push(["group", hash, g, want]);
    for (const [g, p, group, want] of v.operatorIndex) if (KeyGroups.owner(p, g, group) !== want) bad.push(["owner", g, p, group, want]);
    for (const [g, p, i, start, end] of v.ranges) { const r = KeyGroups.range(p, g, i); if (r.start !== start || r.end !== end) bad.push(["range", g, p, i, start, end]); }
    return { bad: bad.slice(0, 5), count: bad.length };
  })()`);
  assertEq(bad.count, 0, `mismatches (first: ${JSON.stringify(bad.bad)})`);
  if (vectors.murmur.length < 50 || vectors.operatorIndex.length < 1000 || vectors.ranges.length < 500) throw new Error("vectors truncated");
});

check("key groups of Flink's string, long and int keys", async () => {
  const cases = [
    ...vectors.stringKeys.map((c) => ["string", c.key, c.maxParallelism, c.keyGroup]),
    ...vectors.longKeys.map((c) => ["long", c.key, c.maxParallelism, c.keyGroup]),
    ...vectors.intKeys.map((c) => ["int", c.key, c.maxParallelism, c.keyGroup]),
  ];
  if (vectors.stringKeys.length < 400 || vectors.longKeys.length < 100 || vectors.intKeys.length < 100) throw new Error("vectors truncated");
  const bad = await page(`(() => {
    const bad = [];
    for (const [type, key, g, want] of ${JSON.stringify(cases)}) {
      const k = KeyGroups.parseKey(key, type);
      const got = k.ok ? KeyGroups.keyGroupForHash(k.hash, g) : k.error;
      if (got !== want) bad.push([type, key, g, want, got]);
    }
    return { bad: bad.slice(0, 5), count: bad.length };
  })()`);
  assertEq(bad.count, 0, `mismatches of ${cases.length} (first: ${JSON.stringify(bad.bad)})`);
});

check("typed keys show Flink's groups and their subtasks", async () => {
  await set("groups", 128);
  await set("from", "");
  await set("parallelism", 3);
  for (const [type, list] of [["string", vectors.stringKeys], ["long", vectors.longKeys], ["int", vectors.intKeys]]) {
    const cases = list.filter((c) => c.maxParallelism === 128 && !c.key.includes("\n") && !c.key.includes("\r")).slice(0, 12);
    if (cases.length < 5) throw new Error(`too few ${type} vectors at 128`);
    await set("key-type", type);
    await set("keys", cases.map((c) => c.key).join("\n") + "\n");
    const rows = await page(`[...document.querySelectorAll("#key-table tbody tr")].map((tr) => [...tr.cells].map((c) => c.textContent))`);
    assertEq(
      rows,
      cases.map((c) => [c.key, String(c.keyGroup), String(Math.floor((c.keyGroup * 3) / 128))]),
      `${type} keys`,
    );
  }
  await set("key-type", "int");
  await set("keys", "12\nx\n");
  const err = await page(`document.querySelectorAll("#key-table tbody tr")[1].textContent`);
  if (!err.includes('line 2: key "x" is not a valid int key')) throw new Error(`error row: ${err}`);
  await set("key-type", "string");
});

if (keyshiftBin) {
  check("plans agree with `keyshift plan -o json`", async () => {
    const grid = [];
    for (const g of [1, 2, 7, 128, 1000, 32768])
      for (const [q, p] of [[1, 1], [1, 2], [2, 1], [3, 5], [4, 8], [8, 4], [5, 3], [7, 7], [24, 200], [100, 128], [128, 100], [33, 999]])
        if (p <= g && q <= g) grid.push([g, q, p]);
    for (const [g, q, p] of grid) {
      const cli = JSON.parse(execFileSync(keyshiftBin, ["plan", "-g", String(g), "-p", String(p), "--from-parallelism", String(q), "-o", "json"], { encoding: "utf8" }));
      const lab = await page(`(() => { const s = KeyGroups.skew(${p}, ${g}); const r = KeyGroups.rescalePlan(${q}, ${p}, ${g});
        return { subtasks: KeyGroups.ranges(${p}, ${g}).map((x, i) => ({ index: i, keyGroups: [x.start, x.end], count: x.end - x.start + 1 })),
          summary: s.summary, minGroups: s.minGroups, maxGroups: s.maxGroups, nearestDivisors: [s.divisorBelow, s.divisorAbove],
          movedGroups: r.movedGroups,
          rescale: r.subtasks.map((t) => ({ index: t.index, keyGroups: [t.start, t.end], pairedWith: t.pairedWith, movedGroups: t.movedGroups,
            reads: t.reads.map((x) => ({ from: x.from, keyGroups: [x.start, x.end], count: x.count })) })) }; })()`);
      const what = `G=${g} ${q} -> ${p}`;
      assertEq(lab.subtasks, cli.subtasks, `${what} ranges`);
      assertEq(lab.summary, cli.summary, `${what} skew`);
      assertEq([lab.minGroups, lab.maxGroups, lab.nearestDivisors], [cli.minGroups, cli.maxGroups, cli.nearestDivisors], `${what} skew numbers`);
      assertEq(lab.movedGroups, cli.rescale.movedGroups, `${what} moved groups`);
      assertEq(lab.rescale, cli.rescale.subtasks, `${what} reads and pairing`);
    }
  });
}

const orbitState = async () => ({
  n: Number(await text("orbit-n")),
  visited: Number(await text("orbit-visited")),
  marked: await page(`document.querySelectorAll("#orbit-circle circle.residue.visited").length`),
});

check("orbit: Step advances, m=8 a=3 visits all 8, m=8 a=2 visits 4, Reset clears", async () => {
  await click("orbit-reset");
  await set("orbit-m", 8);
  await set("orbit-a", 3);
  assertEq(await orbitState(), { n: 0, visited: 0, marked: 0 }, "after Reset");
  await click("orbit-step");
  assertEq(await orbitState(), { n: 1, visited: 1, marked: 1 }, "after one Step");
  assertEq(await text("orbit-at"), "3", "one step of 3");
  for (let i = 0; i < 7; i++) await click("orbit-step");
  assertEq(await orbitState(), { n: 8, visited: 8, marked: 8 }, "m=8 a=3 after 8 steps");
  assertEq(await text("orbit-sequence"), "3, 6, 1, 4, 7, 2, 5, 0", "the orbit of 3 mod 8");
  for (let i = 0; i < 4; i++) await click("orbit-step");
  assertEq((await orbitState()).visited, 8, "no more than 8 after 12 steps");
  // An edit keeps t (n stays 12) and recomputes the orbit from zero.
  await set("orbit-a", 2);
  assertEq(await orbitState(), { n: 12, visited: 4, marked: 4 }, "m=8 a=2 at n=12");
  assertEq(await text("orbit-t"), "6.0", "t kept through the edit");
  await click("orbit-reset");
  assertEq(await orbitState(), { n: 0, visited: 0, marked: 0 }, "after the second Reset");
  for (let i = 0; i < 8; i++) await click("orbit-step");
  assertEq(await orbitState(), { n: 8, visited: 4, marked: 4 }, "m=8 a=2 after 8 steps");
  await click("orbit-reset");
});

check("orbit: Play advances n = floor(2t), Pause holds it", async () => {
  await set("orbit-a", 3);
  const started = Date.now();
  await click("orbit-play");
  // Polled rather than slept for a fixed time: a loaded machine may delay the page's timer.
  let playing = await orbitState();
  while (playing.n < 3) {
    if (Date.now() - started > 15000) throw new Error(`n still ${playing.n} after 15 s of play`);
    await sleep(100);
    playing = await orbitState();
  }
  // n and t as one render left them (read together).
  const [n, t] = await page(`[document.getElementById("orbit-n").textContent, Number(document.getElementById("orbit-t").textContent)]`);
  const elapsed = (Date.now() - started) / 1000;
  // t is shown rounded to 0.1 s, so floor(2t) of the shown value may be one step off n.
  if (Math.abs(Number(n) - Math.floor(2 * t)) > 1) throw new Error(`n = ${n} at t = ${t}`);
  if (t > elapsed + 0.1) throw new Error(`t = ${t} s after ${elapsed} s of play`);
  await click("orbit-play");
  const paused = (await orbitState()).n;
  await sleep(700);
  assertEq((await orbitState()).n, paused, "n while paused");
  assertEq(await text("orbit-play"), "Play", "the button after Pause");
  await click("orbit-reset");
  assertEq((await orbitState()).n, 0, "n after Reset");
});

check("the page says the stride is not parallelism", async () => {
  const t = await page(`document.getElementById("orbit").textContent.replace(/\\s+/g, " ")`);
  if (!t.includes("Changing the stride does not simulate changing parallelism")) throw new Error("the warning is missing");
});

// ---- run --------------------------------------------------------------------------------------

let passed = 0;
let failed = 0;
const finish = async (code) => {
  try {
    chrome.kill("SIGKILL");
  } catch {}
  // Chromium (and its helper processes) may still write to the profile for a moment after the
  // kill: wait for its exit (bounded), and retry the removal. A profile that cannot be removed
  // is reported but does not change the outcome of the checks.
  if (chrome.exitCode === null && chrome.signalCode === null) {
    await Promise.race([new Promise((r) => chrome.once("exit", r)), sleep(5000)]);
  }
  try {
    rmSync(profile, { recursive: true, force: true, maxRetries: 10, retryDelay: 200 });
  } catch (e) {
    console.error(`lab test: could not remove the profile ${profile}: ${e.message}`);
  }
  process.exit(code);
};
const deadline = setTimeout(() => {
  console.error(`lab test: timed out; chromium said:\n${chromeStderr}`);
  console.log(`lab: ${passed} passed, ${failed + 1} failed`);
  finish(1);
}, 120000);

try {
  chrome.on("exit", (code) => {
    if (pending.size) console.error(`chromium exited (${code}):\n${chromeStderr}`);
  });
  const { targetId } = await send("Target.createTarget", { url: "about:blank" });
  ({ sessionId: session } = await send("Target.attachToTarget", { targetId, flatten: true }));
  for (const domain of ["Runtime", "Log", "Network", "Page"]) await send(`${domain}.enable`, {}, session);
  const loaded = waitFor("Page.loadEventFired", 30000);
  await send("Page.navigate", { url: pageUrl }, session);
  await loaded;
  for (const { name, fn } of checks) {
    try {
      await fn();
      passed++;
      console.log(`test ${name} ... ok`);
    } catch (e) {
      failed++;
      console.log(`test ${name} ... FAILED\n    ${e.message}`);
    }
  }
  if (screenshot) {
    await set("parallelism", 8);
    await set("from", 4);
    await set("orbit-a", 3);
    for (let i = 0; i < 5; i++) await click("orbit-step");
    await send("Emulation.setDeviceMetricsOverride", { width: 1100, height: 2200, deviceScaleFactor: 1, mobile: false }, session);
    const { data } = await send("Page.captureScreenshot", { format: "png" }, session);
    writeFileSync(screenshot, Buffer.from(data, "base64"));
  }
  // Last: nothing went wrong in the page while it was driven.
  await sleep(200);
  if (problems.length === 0) {
    passed++;
    console.log("test no console errors, exceptions or requests off file:// ... ok");
  } else {
    failed++;
    console.log(`test no console errors, exceptions or requests off file:// ... FAILED\n    ${problems.join("\n    ")}`);
  }
} catch (e) {
  failed++;
  console.log(`lab test could not drive the page: ${e.message}\n${chromeStderr}`);
}
clearTimeout(deadline);
console.log(`\nlab: ${passed} passed, ${failed} failed`);
finish(failed ? 1 : 0);
