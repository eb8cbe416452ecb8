// The lab page: draws what keygroup.js computes. Everything runs locally; nothing is fetched.
"use strict";

(function () {
  const KG = window.KeyGroups;
  const $ = (id) => document.getElementById(id);
  const SVG_NS = "http://www.w3.org/2000/svg";
  // The colours of `keyshift plan -o svg` (src/plan_svg.rs), by subtask index.
  const PALETTE = ["#8fb8de", "#f4b183", "#a9d18e", "#ffd966", "#c5a3d9", "#9dd5d0", "#f4a3b4", "#c9c9c9", "#d6c28b", "#b4c7e7"];
  const MAX_TABLE_ROWS = 512;

  /** An integer from an input, or null when the field is empty or not a whole number. */
  function intOf(input) {
    const t = input.value.trim();
    if (t === "" || !/^-?[0-9]+$/.test(t)) return null;
    return Number(t);
  }

  function svgEl(name, attrs, parent) {
    const e = document.createElementNS(SVG_NS, name);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
    if (parent) parent.appendChild(e);
    return e;
  }

  function cell(row, text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    row.appendChild(td);
    return td;
  }

  // ---- 1. key groups and subtasks -------------------------------------------------------------

  /** The current, validated inputs of section 1, or null (with the message shown). */
  function assignmentInputs() {
    const g = intOf($("groups"));
    const p = intOf($("parallelism"));
    const fromText = $("from").value.trim();
    const from = fromText === "" ? null : intOf($("from"));
    let error = null;
    if (g === null) error = "key groups G must be a whole number";
    else if (p === null) error = "parallelism p must be a whole number";
    else if (fromText !== "" && from === null) error = "rescale from must be a whole number (or empty)";
    else error = KG.boundsError(p, g) || (from === null ? null : KG.boundsError(from, g));
    $("bounds-error").textContent = error || "";
    return error ? null : { g, p, from };
  }

  function drawStrips(g, p, from, plan) {
    const width = 940;
    const left = 10;
    const stripW = width - 2 * left;
    const stripH = 40;
    const scale = stripW / g;
    const rows = from === null ? 1 : 2;
    const height = rows * (stripH + 26) + 10;
    const svg = svgEl("svg", { xmlns: SVG_NS, width, height, viewBox: `0 0 ${width} ${height}`, "font-size": 12, "font-family": "Helvetica, Arial, sans-serif" });
    const defs = svgEl("defs", {}, svg);
    const pattern = svgEl("pattern", { id: "lab-moved", width: 6, height: 6, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" }, defs);
    svgEl("line", { x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#c0392b", "stroke-width": 2.5, "stroke-opacity": 0.6 }, pattern);
    let y = 16;
    const strip = (name, label, rs) => {
      const title = svgEl("text", { x: left, y, "font-weight": "bold" }, svg);
      title.textContent = label;
      y += 6;
      rs.forEach((r, i) => {
        const count = r.end - r.start + 1;
        const x = left + r.start * scale;
        const w = count * scale;
        const rect = svgEl("rect", { class: "range", "data-strip": name, "data-subtask": i, "data-start": r.start, "data-end": r.end, x, y, width: w, height: stripH, fill: PALETTE[i % PALETTE.length], stroke: "#fff" }, svg);
        svgEl("title", {}, rect).textContent = `subtask ${i}: groups ${r.start}-${r.end} (${count})`;
        const text = `#${i} ${r.start}-${r.end}`;
        const short = `#${i}`;
        const fits = (t) => t.length * 6.6 + 4 <= w;
        if (fits(text) || fits(short)) {
          const t = svgEl("text", { x: x + w / 2, y: y + stripH / 2 + 4, "text-anchor": "middle" }, svg);
          t.textContent = fits(text) ? text : short;
        }
      });
      const top = y;
      y += stripH + 20;
      return top;
    };
    if (from !== null) strip("old", `before: parallelism ${from}`, KG.ranges(from, g));
    const top = strip("new", from === null ? `parallelism ${p}` : `after: parallelism ${p}`, KG.ranges(p, g));
    if (plan) {
      for (const st of plan.subtasks) {
        for (const r of st.reads) {
          if (r.from === st.pairedWith) continue;
          const m = svgEl("rect", { class: "moved", "data-subtask": st.index, "data-from": r.from, "data-groups": r.count, x: left + r.start * scale, y: top, width: r.count * scale, height: stripH, fill: "url(#lab-moved)", stroke: "#c0392b" }, svg);
          svgEl("title", {}, m).textContent = `groups ${r.start}-${r.end} move from old subtask ${r.from} to new subtask ${st.index}`;
        }
      }
    }
    $("strips").replaceChildren(svg);
  }

  function renderAssignment() {
    const inputs = assignmentInputs();
    const tbody = $("ranges").tBodies[0];
    if (!inputs) {
      $("strips").replaceChildren();
      tbody.replaceChildren();
      $("rescale-summary").textContent = "";
      $("skew").textContent = "";
      $("ranges-more").textContent = "";
      renderKeys();
      return;
    }
    const { g, p, from } = inputs;
    const plan = from === null ? null : KG.rescalePlan(from, p, g);
    drawStrips(g, p, from, plan);
    $("skew").textContent = KG.skew(p, g).summary;
    const summary = $("rescale-summary");
    summary.replaceChildren();
    if (plan) {
      summary.append(`rescale ${from} -> ${p}: `);
      const moved = document.createElement("span");
      moved.id = "moved";
      moved.className = "moved-count";
      moved.textContent = String(plan.movedGroups);
      summary.append(moved, ` of ${g} key groups (${(plan.movedFraction * 100).toFixed(1)}%) change owner when each new subtask replaces the old subtask it overlaps most (hatched)`);
    }
    const rows = [];
    const rs = KG.ranges(p, g);
    for (let i = 0; i < Math.min(p, MAX_TABLE_ROWS); i++) {
      const tr = document.createElement("tr");
      const r = rs[i];
      cell(tr, String(i));
      cell(tr, `${r.start}-${r.end}`, "groups");
      cell(tr, String(r.end - r.start + 1), "count");
      if (plan) {
        const st = plan.subtasks[i];
        cell(tr, st.pairedWith === null ? "-" : String(st.pairedWith));
        cell(tr, String(st.movedGroups), "moved");
        cell(tr, st.reads.map((x) => `${x.from}: ${x.start}-${x.end}`).join(", "), "text");
      } else {
        cell(tr, "");
        cell(tr, "");
        cell(tr, "");
      }
      rows.push(tr);
    }
    tbody.replaceChildren(...rows);
    $("ranges-more").textContent = p > MAX_TABLE_ROWS ? `... and ${p - MAX_TABLE_ROWS} more subtasks (the table shows the first ${MAX_TABLE_ROWS})` : "";
    renderKeys();
  }

  // ---- 2. keys ---------------------------------------------------------------------------------

  /** Lines as `keyshift keygroup` reads stdin: split on \n, a trailing \r dropped, no last empty line. */
  function keyLines(text) {
    if (text === "") return [];
    const lines = text.split("\n").map((l) => (l.endsWith("\r") ? l.slice(0, -1) : l));
    if (text.endsWith("\n")) lines.pop();
    return lines;
  }

  function renderKeys() {
    const tbody = $("key-table").tBodies[0];
    const inputs = assignmentInputs();
    const type = $("key-type").value;
    const rows = [];
    keyLines($("keys").value).forEach((line, n) => {
      const tr = document.createElement("tr");
      const parsed = KG.parseKey(line, type);
      cell(tr, line, "text key");
      if (!parsed.ok) {
        const td = cell(tr, `line ${n + 1}: ${parsed.error}`, "text error");
        td.colSpan = 2;
      } else if (!inputs) {
        cell(tr, "-", "group");
        cell(tr, "-", "subtask");
      } else {
        const group = KG.keyGroupForHash(parsed.hash, inputs.g);
        cell(tr, String(group), "group");
        cell(tr, String(KG.owner(inputs.p, inputs.g, group)), "subtask");
      }
      rows.push(tr);
    });
    tbody.replaceChildren(...rows);
  }

  // ---- 3. the modular orbit toy ------------------------------------------------------------------

  const orbit = { playing: false, startedAt: 0, pausedT: 0, timer: null };

  function orbitT() {
    return orbit.playing ? (performance.now() - orbit.startedAt) / 1000 : orbit.pausedT;
  }

  function setOrbitT(t) {
    if (orbit.playing) orbit.startedAt = performance.now() - t * 1000;
    else orbit.pausedT = t;
  }

  function gcd(a, b) {
    while (b !== 0) [a, b] = [b, a % b];
    return a;
  }

  function renderOrbit() {
    const t = orbitT();
    const n = Math.floor(2 * t);
    $("orbit-t").textContent = t.toFixed(1);
    $("orbit-n").textContent = String(n);
    const m = intOf($("orbit-m"));
    const a = intOf($("orbit-a"));
    let error = "";
    if (m === null || m < 1 || m > 720) error = "modulus m must be a whole number from 1 to 720";
    else if (a === null || a < 0) error = "stride a must be a whole number, 0 or more";
    $("orbit-error").textContent = error;
    if (error) return;
    // Steps 1..n visit k*a mod m; the orbit repeats after m/gcd(a,m) steps, so at most that many
    // steps are walked whatever n is.
    const period = m / gcd(a % m, m);
    const visited = new Set();
    const sequence = [];
    for (let k = 1; k <= Math.min(n, period); k++) {
      const r = ((k % m) * (a % m)) % m;
      visited.add(r);
      sequence.push(r);
    }
    const at = ((n % m) * (a % m)) % m;
    $("orbit-visited").textContent = String(visited.size);
    $("orbit-of").textContent = String(m);
    $("orbit-period").textContent = String(period);
    $("orbit-at").textContent = n === 0 ? "0 (start)" : String(at);
    $("orbit-sequence").textContent = n === 0 ? "none" : sequence.join(", ") + (n > period ? `, then the same ${period} again` : "");
    drawCircle(m, visited, n === 0 ? null : at);
  }

  function drawCircle(m, visited, at) {
    const size = 260;
    const c = size / 2;
    const radius = 100;
    const svg = svgEl("svg", { xmlns: SVG_NS, width: size, height: size, viewBox: `0 0 ${size} ${size}`, "font-size": 11, "font-family": "Helvetica, Arial, sans-serif" });
    svgEl("circle", { cx: c, cy: c, r: radius, fill: "none", stroke: "#ccc" }, svg);
    const dot = m > 60 ? 3 : 8;
    for (let r = 0; r < m; r++) {
      const angle = (2 * Math.PI * r) / m - Math.PI / 2;
      const x = c + radius * Math.cos(angle);
      const y = c + radius * Math.sin(angle);
      const isAt = r === at;
      svgEl("circle", { class: visited.has(r) ? "residue visited" : "residue", "data-residue": r, cx: x, cy: y, r: isAt ? dot + 3 : dot, fill: visited.has(r) ? "#1f5fbf" : "#fff", stroke: isAt ? "#c0392b" : "#1f5fbf", "stroke-width": isAt ? 3 : 1.5 }, svg);
      if (m <= 60) {
        const t = svgEl("text", { x: c + (radius + 18) * Math.cos(angle), y: c + (radius + 18) * Math.sin(angle) + 4, "text-anchor": "middle" }, svg);
        t.textContent = String(r);
      }
    }
    $("orbit-circle").replaceChildren(svg);
  }

  function play() {
    if (orbit.playing) {
      orbit.pausedT = orbitT();
      orbit.playing = false;
      clearInterval(orbit.timer);
      orbit.timer = null;
      $("orbit-play").textContent = "Play";
    } else {
      orbit.startedAt = performance.now() - orbit.pausedT * 1000;
      orbit.playing = true;
      orbit.timer = setInterval(renderOrbit, 50);
      $("orbit-play").textContent = "Pause";
    }
    renderOrbit();
  }

  function step() {
    setOrbitT((Math.floor(2 * orbitT()) + 1) / 2);
    renderOrbit();
  }

  function reset() {
    if (orbit.playing) play();
    orbit.pausedT = 0;
    renderOrbit();
  }

  for (const id of ["groups", "parallelism", "from"]) $(id).addEventListener("input", renderAssignment);
  $("key-type").addEventListener("change", renderKeys);
  $("keys").addEventListener("input", renderKeys);
  for (const id of ["orbit-m", "orbit-a"]) $(id).addEventListener("input", renderOrbit);
  $("orbit-play").addEventListener("click", play);
  $("orbit-step").addEventListener("click", step);
  $("orbit-reset").addEventListener("click", reset);

  renderAssignment();
  renderOrbit();
})();
