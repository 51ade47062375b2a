// Checks of the plan page's script, run inside the page (plan_html_test.sh appends this file as
// a second script, which sees the page's top-level bindings). Each check compares the page's
// result with a plain recomputation from P; the outcome is the text of a new div, id "check":
// "CHECK PASS n" or "CHECK FAIL" and the first failures.
"use strict";
(function () {
  const failures = [];
  let checks = 0;
  function expect(ok, what) {
    ++checks;
    if (!ok && failures.length < 12) failures.push(what);
  }
  let seed = 12345;
  function random() {  // deterministic: a failure repeats
    seed = (seed * 1103515245 + 12345) % 2147483648;
    return seed / 2147483648;
  }
  const drawnNow = () => Number(document.getElementById("drawn").textContent);

  // Culling: a buffer is drawn when its rectangle overlaps the view's open box.
  function expectedDrawn(v) {
    let n = 0;
    for (let i = 0; i < N; ++i) {
      const overlapsTime = P.lower[i] < v.t1 && v.t0 < P.upper[i];
      const overlapsBytes = P.offset[i] < v.y1 && v.y0 < P.offset[i] + P.bytes[i];
      if (overlapsTime && overlapsBytes) ++n;
    }
    return n;
  }
  function drawAt(v) {
    view = Object.assign({}, v);
    draw();
    expect(drawnNow() === expectedDrawn(v),
           "drawn " + drawnNow() + " in view " + JSON.stringify(v) + ", expected " + expectedDrawn(v));
  }
  drawAt(full);
  for (let k = 0; k < 200; ++k) {
    const i = Math.floor(random() * N), j = Math.floor(random() * N);
    // Views whose edges sit exactly on buffers' edges, and views around them.
    const ts = [P.lower[i], P.upper[i], P.lower[j], P.upper[j]].sort((a, b) => a - b);
    const bs = [P.offset[i], P.offset[i] + P.bytes[i], P.offset[j], P.offset[j] + P.bytes[j]].sort((a, b) => a - b);
    const pick = (a) => a[Math.floor(random() * a.length)];
    let t0 = pick(ts), t1 = pick(ts), y0 = pick(bs), y1 = pick(bs);
    if (random() < 0.3) { t0 -= 0.5; t1 += 0.5; }
    if (t1 <= t0) t1 = t0 + 1;
    if (y1 <= y0) y1 = y0 + 1;
    drawAt({t0: t0, t1: t1, y0: y0, y1: y1});
  }

  // Ticks: every label drawn is recorded by a wrapper around fillText.
  const labels = [];
  const fillText = ctx.fillText;
  ctx.fillText = function (text, x, y) { labels.push({text: String(text), x: x, y: y}); };
  function ticksAt(v) {
    view = Object.assign({}, v);
    labels.length = 0;
    draw();
    const bottom = M.top + plotH();
    const times = labels.filter(l => l.y === bottom + 18).map(l => Number(l.text));
    const bytes = labels.filter(l => l.x === M.left - 8);
    const span = v.t1 - v.t0;
    const what = " at " + JSON.stringify(v) + ": " + JSON.stringify(times);
    // Every multiple of the step in the view: the step the smallest 1, 2 or 5 x 10^k (at
    // least 1) that makes at most 8 intervals of the span.
    let step = niceStep(span, 8);
    step = Math.max(1, Math.round(step));
    const expected = [];
    for (let t = Math.ceil(v.t0 / step) * step; t <= v.t1; t += step) expected.push(t);
    expect(JSON.stringify(times) === JSON.stringify(expected), "time ticks, expected " + JSON.stringify(expected) + what);
    // Bytes: in units of the largest power of 1024 within the range (at most 2^60), the
    // smallest 1, 2 or 5 x 10^k of them that makes at most 6 intervals, or under one unit the
    // smallest binary fraction of one that does; every multiple of it in the view.
    const range = v.y1 - v.y0;
    let unit = 1;
    for (let e = 1; e <= 6; ++e) if (Math.pow(1024, e) <= range) unit = Math.pow(1024, e);
    let ys = niceStep(range / unit, 6);
    if (ys < 1) {
      ys = 1;
      for (let j = 1; j <= 60; ++j) if (Math.pow(2, -j) >= range / unit / 6) ys = Math.pow(2, -j);
    }
    ys *= unit;
    const expectedBytes = [];
    for (let k = Math.ceil(v.y0 / ys); k * ys <= v.y1; ++k) expectedBytes.push(k * ys);
    expect(JSON.stringify(bytes.map(l => l.text)) === JSON.stringify(expectedBytes.map(human)),
           "byte ticks " + JSON.stringify(bytes.map(l => l.text)) + ", expected " +
           JSON.stringify(expectedBytes.map(human)) + " at " + JSON.stringify(v));
    expect(bytes.every((l, n) => n >= expectedBytes.length || Math.abs(l.y - (yOf(expectedBytes[n]) + 4)) < 1e-6),
           "byte ticks misplaced at " + JSON.stringify(v));
  }
  // The smallest 1, 2 or 5 x 10^k at or above range / intervals.
  function niceStep(range, intervals) {
    let best = Infinity;
    for (let k = -15; k <= 20; ++k) {
      for (const m of [1, 2, 5]) {
        const s = m * Math.pow(10, k);
        if (s >= range / intervals && s < best) best = s;
      }
    }
    return best;
  }
  ticksAt(full);
  ticksAt({t0: 0, t1: 1, y0: 0, y1: 1});
  ticksAt({t0: 3, t1: 13, y0: 1000, y1: 3000});
  ticksAt({t0: 0, t1: 100, y0: 0, y1: 1024});
  ticksAt({t0: 7.5, t1: 8.25, y0: 0, y1: 300 * 1024 * 1024});
  ticksAt({t0: 0, t1: 16, y0: 0, y1: 1048576});
  ticksAt({t0: 0, t1: 80, y0: 0, y1: 3});
  ticksAt({t0: 0, t1: 8, y0: 0, y1: Math.pow(2, 70)});
  ticksAt({t0: -5, t1: 1e6, y0: 1, y1: 1024 * 1024 - 1});
  for (let k = 0; k < 100; ++k) {
    const t0 = Math.floor(random() * 1000), y0 = Math.floor(random() * 1e6);
    ticksAt({t0: t0, t1: t0 + 1 + random() * Math.pow(10, 1 + 5 * random()),
             y0: y0, y1: y0 + 64 + random() * Math.pow(2, 10 + 40 * random())});
  }
  ctx.fillText = fillText;

  // The rectangles drawn: one per buffer in the view, in buffer order, from its lifetime and
  // bytes through the canvas mapping, at least one pixel each way.
  const fillRect = ctx.fillRect;
  const rects = [];
  ctx.fillRect = function (x, y, w, h) { rects.push([x, y, w, h]); };
  for (const v of [full, {t0: full.t0 + (full.t1 - full.t0) / 3, t1: full.t0 + (full.t1 - full.t0) / 2,
                          y0: full.y1 / 5, y1: full.y1 / 2}]) {
    view = Object.assign({}, v);
    rects.length = 0;
    draw();
    const want = [];
    for (let i = 0; i < N; ++i) {
      if (!(P.lower[i] < v.t1 && v.t0 < P.upper[i] && P.offset[i] < v.y1 && v.y0 < P.offset[i] + P.bytes[i])) continue;
      const x = xOf(P.lower[i]), y = yOf(P.offset[i] + P.bytes[i]);
      want.push([x, y, Math.max(1, xOf(P.upper[i]) - x), Math.max(1, yOf(P.offset[i]) - y)]);
    }
    expect(JSON.stringify(rects) === JSON.stringify(want), "rectangles " + JSON.stringify(rects.slice(0, 3)) +
           ", expected " + JSON.stringify(want.slice(0, 3)) + " at " + JSON.stringify(v));
  }
  ctx.fillRect = fillRect;

  // The tooltip's text of every buffer.
  for (let i = 0; i < N; ++i) {
    const want = P.ids[i] + "\n" + P.bytes[i] + " bytes (" + human(P.bytes[i]) + ")\nlifetime [" + P.lower[i] +
                 ", " + P.upper[i] + "), " + (P.upper[i] - P.lower[i]) + " steps\noffset " + P.offset[i] +
                 " (" + human(P.offset[i]) + ")";
    expect(describe(i) === want, "describe(" + i + ") = " + JSON.stringify(describe(i)));
  }

  // Units: the label of a byte count.
  for (const [b, text] of [[0, "0 B"], [1023, "1023 B"], [1024, "1.00 KiB"], [1536, "1.50 KiB"],
                           [99 * 1024, "99.0 KiB"], [100 * 1024, "100 KiB"], [1023 * 1024, "1023 KiB"],
                           [1048576, "1.00 MiB"], [Math.pow(2, 60), "1.00 EiB"], [Math.pow(2, 70), "1024 EiB"]]) {
    expect(human(b) === text, "human(" + b + ") = " + human(b) + ", not " + text);
  }

  // The hit test at the edges of every buffer, in plan coordinates (the canvas mapping made
  // the identity): [lower, upper) x [offset, offset + bytes).
  const mapT = tOf, mapB = bOf;
  tOf = x => x;
  bOf = y => y;
  function under(t, b) {
    const hits = [];
    for (let i = 0; i < N; ++i) {
      if (!(t < P.lower[i] || t >= P.upper[i] || b < P.offset[i] || b >= P.offset[i] + P.bytes[i])) hits.push(i);
    }
    return hits.length === 1 ? hits[0] : -1;
  }
  for (let i = 0; i < N; ++i) {
    const last = P.upper[i] - 1, top = P.offset[i] + P.bytes[i];
    if (P.bytes[i] === 0) {
      expect(bufferAt(P.lower[i], P.offset[i]) !== i, "an empty buffer " + P.ids[i] + " hit");
      continue;
    }
    for (const [t, b] of [[P.lower[i], P.offset[i]], [last + 0.5, top - 0.5], [P.lower[i], top - 0.5],
                          [last + 0.5, P.offset[i]]]) {
      expect(bufferAt(t, b) === i, "(" + t + ", " + b + ") inside " + P.ids[i] + " gave " + bufferAt(t, b));
    }
    for (const [t, b] of [[P.upper[i], P.offset[i]], [P.lower[i], top], [P.lower[i] - 0.5, P.offset[i]],
                          [P.lower[i], P.offset[i] - 0.5]]) {
      expect(bufferAt(t, b) === under(t, b), "(" + t + ", " + b + ") at the edge of " + P.ids[i] + " gave " +
             bufferAt(t, b) + ", expected " + under(t, b));
      expect(bufferAt(t, b) !== i, "(" + t + ", " + b + ") outside " + P.ids[i] + " hit it");
    }
  }
  for (let k = 0; k < 2000; ++k) {
    const t = full.t0 + random() * (full.t1 - full.t0), b = random() * full.y1;
    expect(bufferAt(t, b) === under(t, b), "(" + t + ", " + b + ") gave " + bufferAt(t, b) + ", expected " + under(t, b));
  }
  tOf = mapT;
  bOf = mapB;

  // The canvas mapping: the plot is the canvas less margins of 90 + 20 by 16 + 46 pixels; xOf/tOf and
  // yOf/bOf are inverses and put the view's corners at the plot's, in a view away from the origin.
  expect(canvas.clientWidth > 200 && canvas.clientHeight > 200, "canvas size " + canvas.clientWidth);
  expect(plotW() === canvas.clientWidth - 110 && plotH() === canvas.clientHeight - 62, "plot size " + plotW());
  view = {t0: full.t0 + (full.t1 - full.t0) / 4, t1: full.t1 - (full.t1 - full.t0) / 8,
          y0: full.y1 / 5, y1: full.y1 / 2};
  draw();
  expect(Math.abs(xOf(view.t0) - M.left) < 1e-9 && Math.abs(xOf(view.t1) - (M.left + plotW())) < 1e-9, "xOf corners");
  expect(Math.abs(yOf(view.y0) - (M.top + plotH())) < 1e-9 && Math.abs(yOf(view.y1) - M.top) < 1e-9, "yOf corners");
  for (let k = 0; k < 100; ++k) {
    const x = M.left + random() * plotW(), y = M.top + random() * plotH();
    expect(Math.abs(xOf(tOf(x)) - x) < 1e-6 && Math.abs(yOf(bOf(y)) - y) < 1e-6, "mapping round trip at " + x + ", " + y);
  }

  const out = document.createElement("div");
  out.id = "check";
  out.textContent = failures.length ? "CHECK FAIL " + failures.join(" ; ") : "CHECK PASS " + checks;
  document.body.appendChild(out);
})();
