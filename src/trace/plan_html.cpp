// The interactive plan page: the data as JavaScript arrays, drawn by the page's own script.

#include <cstdio>
#include <ostream>
#include <string>

#include "tensormem/trace/plan_svg.hpp"
#include "svg_support.hpp"
#include "write_file.hpp"

namespace tensormem::trace {

namespace {

// A JavaScript string literal with no '<' or '>' in it (written \u003c, \u003e): no text can
// close the script element ("</script>") or change how the HTML parser reads it ("<!--" then
// "<script" would swallow the rest of the page).
void js_string(std::ostream& out, const std::string& s) {
  out << '"';
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out << '\\' << c;
    } else if (u < 0x20 || u == 0x7f || c == '<' || c == '>') {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", u);
      out << escaped;
    } else {
      out << c;
    }
  }
  out << '"';
}

template <class Field>
void js_numbers(std::ostream& out, const char* name, std::size_t n, Field field) {
  out << name << ":[";
  for (std::size_t i = 0; i < n; ++i) out << (i ? "," : "") << field(i);
  out << "],\n";
}

// The page before the data: style, header bar, canvas, tooltip.
constexpr const char* page_head = R"page(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>tensormem plan</title>
<style>
body{margin:0;font:13px sans-serif;color:#222;background:#fff;overflow:hidden}
#bar{height:34px;padding:0 10px;display:flex;overflow:hidden;gap:18px;align-items:center;border-bottom:1px solid #ddd;white-space:nowrap}
#plot{display:block;width:100vw;height:calc(100vh - 35px);cursor:crosshair}
#tip{position:fixed;pointer-events:none;background:#fffbe6;border:1px solid #888;padding:4px 6px;display:none;white-space:pre;font:12px monospace}
.key{display:inline-block;width:18px;height:0;vertical-align:middle;margin-right:4px}
.hint{color:#666}
</style></head><body>
<div id="bar"><b id="title"></b><b id="invalid" style="color:#c00"></b><span>drawn: <span id="drawn">0</span> buffers</span>
<span><span class="key" style="border-top:2px dashed #c00"></span>lower bound</span>
<span><span class="key" style="border-top:2px solid #000"></span>arena</span>
<span class="hint">wheel: zoom (shift: time only, alt: bytes only) &middot; drag: pan &middot; double-click: reset</span>
</div>
<canvas id="plot"></canvas><div id="tip"></div><div id="selftest" hidden></div>
<script>
"use strict";
const P = {
)page";

// The page after the data: drawing, zoom, pan, hover and the self-test.
constexpr const char* page_tail = R"page(};
const N = P.lower.length;
const canvas = document.getElementById("plot");
const ctx = canvas.getContext("2d");
const tip = document.getElementById("tip");
const M = {left: 90, right: 20, top: 16, bottom: 46};
let t0 = 0, t1 = 1;
for (let i = 0; i < N; ++i) { if (i === 0 || P.lower[i] < t0) t0 = P.lower[i]; if (P.upper[i] > t1) t1 = P.upper[i]; }
const yMax = Math.max(P.arena, P.lb, 1);
const full = {t0: t0, t1: Math.max(t1, t0 + 1), y0: 0, y1: yMax * 1.04};
let view = Object.assign({}, full);
const colors = [];
for (let h = 0; h < 360; ++h) colors.push("hsl(" + h + ",60%,65%)");
function human(b) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
  let k = 0;
  while (Math.abs(b) >= 1024 && k < 6) { b /= 1024; ++k; }
  return (k === 0 || Math.abs(b) >= 100 ? b.toFixed(0) : b.toPrecision(3)) + " " + u[k];
}
function tickStep(range, ticks) {
  const raw = range / ticks;
  let p = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 5, 10]) if (p * m >= raw) return p * m;
  return p * 10;
}
function plotW() { return canvas.clientWidth - M.left - M.right; }
function plotH() { return canvas.clientHeight - M.top - M.bottom; }
function xOf(t) { return M.left + plotW() * (t - view.t0) / (view.t1 - view.t0); }
function yOf(b) { return M.top + plotH() * (1 - (b - view.y0) / (view.y1 - view.y0)); }
function tOf(x) { return view.t0 + (x - M.left) / plotW() * (view.t1 - view.t0); }
function bOf(y) { return view.y0 + (1 - (y - M.top) / plotH()) * (view.y1 - view.y0); }
function draw() {
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(canvas.clientWidth * dpr);
  canvas.height = Math.round(canvas.clientHeight * dpr);
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, canvas.clientWidth, canvas.clientHeight);
  ctx.save();
  ctx.beginPath();
  ctx.rect(M.left, M.top, plotW(), plotH());
  ctx.clip();
  let drawn = 0;
  for (let i = 0; i < N; ++i) {
    if (P.upper[i] <= view.t0 || P.lower[i] >= view.t1) continue;
    const top = P.offset[i] + P.bytes[i];
    if (top <= view.y0 || P.offset[i] >= view.y1) continue;
    const x = xOf(P.lower[i]);
    const y = yOf(top);
    ctx.fillStyle = colors[(i * 137) % 360];
    ctx.fillRect(x, y, Math.max(1, xOf(P.upper[i]) - x), Math.max(1, yOf(P.offset[i]) - y));
    ++drawn;
  }
  ctx.lineWidth = 1.5;
  ctx.setLineDash([6, 4]);
  ctx.strokeStyle = "#c00";
  hline(P.lb);
  ctx.setLineDash([]);
  ctx.strokeStyle = "#000";
  hline(P.arena);
  ctx.font = "12px sans-serif";
  ctx.textAlign = "right";
  ctx.fillStyle = "#000";
  ctx.fillText("arena " + human(P.arena), M.left + plotW() - 4, yOf(P.arena) - 4);
  ctx.fillStyle = "#c00";
  ctx.fillText("lower bound " + human(P.lb), M.left + plotW() - 4, yOf(P.lb) + 14);
  ctx.restore();
  axes();
  document.getElementById("drawn").textContent = String(drawn);
}
function hline(b) {
  ctx.beginPath();
  ctx.moveTo(M.left, yOf(b));
  ctx.lineTo(M.left + plotW(), yOf(b));
  ctx.stroke();
}
function axes() {
  const bottom = M.top + plotH();
  ctx.strokeStyle = "#222";
  ctx.fillStyle = "#222";
  ctx.lineWidth = 1;
  ctx.beginPath();
  ctx.moveTo(M.left, M.top); ctx.lineTo(M.left, bottom); ctx.lineTo(M.left + plotW(), bottom);
  ctx.stroke();
  ctx.font = "12px sans-serif";
  ctx.textAlign = "center";
  const ts = Math.max(1, tickStep(view.t1 - view.t0, 8));
  for (let t = Math.ceil(view.t0 / ts) * ts; t <= view.t1; t += ts) {
    ctx.beginPath(); ctx.moveTo(xOf(t), bottom); ctx.lineTo(xOf(t), bottom + 5); ctx.stroke();
    ctx.fillText(String(t), xOf(t), bottom + 18);
  }
  ctx.fillText("time step (a buffer lives over [first, last))", M.left + plotW() / 2, bottom + 38);
  let unit = 1;
  while (unit * 1024 <= view.y1 - view.y0 && unit < 1152921504606846976) unit *= 1024;
  // Under one unit, binary fractions of it (256 KiB, not 0.2 MiB).
  let ys = tickStep((view.y1 - view.y0) / unit, 6);
  if (ys < 1) { ys = 1; while (ys / 2 >= (view.y1 - view.y0) / unit / 6) ys /= 2; }
  ys *= unit;
  ctx.textAlign = "right";
  for (let b = Math.ceil(view.y0 / ys) * ys; b <= view.y1; b += ys) {
    ctx.beginPath(); ctx.moveTo(M.left - 5, yOf(b)); ctx.lineTo(M.left, yOf(b)); ctx.stroke();
    ctx.fillText(human(b), M.left - 8, yOf(b) + 4);
  }
}
// The buffer under a point of the canvas, or -1 (a valid plan has at most one).
function bufferAt(x, y) {
  const t = tOf(x), b = bOf(y);
  for (let i = 0; i < N; ++i) {
    if (P.lower[i] <= t && t < P.upper[i] && P.offset[i] <= b && b < P.offset[i] + P.bytes[i]) return i;
  }
  return -1;
}
function describe(i) {
  return P.ids[i] + "\n" + P.bytes[i] + " bytes (" + human(P.bytes[i]) + ")\n" +
         "lifetime [" + P.lower[i] + ", " + P.upper[i] + "), " + (P.upper[i] - P.lower[i]) + " steps\n" +
         "offset " + P.offset[i] + " (" + human(P.offset[i]) + ")";
}
function local(e) {
  const r = canvas.getBoundingClientRect();
  return [e.clientX - r.left, e.clientY - r.top];
}
let drag = null;
canvas.addEventListener("mousemove", e => {
  const [x, y] = local(e);
  if (drag) {
    const dt = (x - drag.x) / plotW() * (view.t1 - view.t0);
    const db = (y - drag.y) / plotH() * (view.y1 - view.y0);
    view.t0 -= dt; view.t1 -= dt; view.y0 += db; view.y1 += db;
    drag = {x: x, y: y};
    draw();
    return;
  }
  const i = bufferAt(x, y);
  if (i < 0) { tip.style.display = "none"; return; }
  tip.textContent = describe(i);
  tip.style.display = "block";
  tip.style.left = (e.clientX + 14) + "px";
  tip.style.top = (e.clientY + 14) + "px";
});
canvas.addEventListener("mousedown", e => { const [x, y] = local(e); drag = {x: x, y: y}; });
window.addEventListener("mouseup", () => { drag = null; });
canvas.addEventListener("mouseleave", () => { tip.style.display = "none"; });
canvas.addEventListener("dblclick", () => { view = Object.assign({}, full); draw(); });
canvas.addEventListener("wheel", e => {
  e.preventDefault();
  const [x, y] = local(e);
  const f = Math.pow(1.0015, e.deltaY);
  const t = tOf(x), b = bOf(y);
  if (!e.altKey) { view.t0 = t + (view.t0 - t) * f; view.t1 = t + (view.t1 - t) * f; }
  if (!e.shiftKey) { view.y0 = b + (view.y0 - b) * f; view.y1 = b + (view.y1 - b) * f; }
  draw();
}, {passive: false});
window.addEventListener("resize", draw);
document.getElementById("title").textContent = P.title + ": " + N + " buffers, arena " + human(P.arena) +
    ", lower bound " + human(P.lb) + " (" + (P.lb > 0 ? (P.arena / P.lb).toFixed(4) : P.arena === 0 ? "1.0000" : "n/a") + " x)";
document.title = "tensormem plan: " + P.title;
if (P.invalid) document.getElementById("invalid").textContent = "not a valid plan: " + P.invalid;
draw();
if (location.hash === "#selftest" && N > 0) {
  // Zoom in once about the centre of the buffer with the largest area, then hover it there.
  let k = 0;
  for (let i = 1; i < N; ++i) {
    if (P.bytes[i] * (P.upper[i] - P.lower[i]) > P.bytes[k] * (P.upper[k] - P.lower[k])) k = i;
  }
  const r = canvas.getBoundingClientRect();
  const cx = r.left + xOf((P.lower[k] + P.upper[k]) / 2), cy = r.top + yOf(P.offset[k] + P.bytes[k] / 2);
  const before = view.t1 - view.t0, drawnBefore = document.getElementById("drawn").textContent;
  canvas.dispatchEvent(new WheelEvent("wheel", {deltaY: -400, clientX: cx, clientY: cy, bubbles: true, cancelable: true}));
  canvas.dispatchEvent(new MouseEvent("mousemove", {clientX: cx, clientY: cy, bubbles: true}));
  const hovered = tip.style.display === "block" ? tip.textContent.replace(/\n/g, " | ") : "nothing";
  document.getElementById("selftest").textContent = "hover: " + hovered + " ; zoom: time span " + before +
      " to " + (view.t1 - view.t0) + ", drawn " + drawnBefore + " to " + document.getElementById("drawn").textContent;
}
</script></body></html>
)page";

}  // namespace

std::string write_plan_html(std::ostream& out, std::span<const core::buffer> buffers,
                            std::span<const std::uint64_t> offsets, std::uint64_t arena_bytes,
                            std::uint64_t lower_bound, const std::string& title,
                            const known_problem& validated) {
  const std::size_t n = buffers.size();
  const std::string problem = detail::picture_problem(buffers, offsets, arena_bytes, validated);
  out << page_head << "title:";
  js_string(out, title);
  out << ",\ninvalid:";
  js_string(out, problem);
  out << ",\narena:" << arena_bytes << ",\nlb:" << lower_bound << ",\nids:[";
  for (std::size_t i = 0; i < n; ++i) {
    if (i) out << ',';
    js_string(out, buffers[i].id);
  }
  out << "],\n";
  js_numbers(out, "lower", n, [&](std::size_t i) { return buffers[i].lower; });
  js_numbers(out, "upper", n, [&](std::size_t i) { return buffers[i].upper; });
  js_numbers(out, "offset", n, [&](std::size_t i) { return offsets[i]; });
  js_numbers(out, "bytes", n, [&](std::size_t i) { return buffers[i].bytes; });
  out << page_tail;
  return problem;
}

std::string write_plan_html(const std::string& path, std::span<const core::buffer> buffers,
                            std::span<const std::uint64_t> offsets, std::uint64_t arena_bytes,
                            std::uint64_t lower_bound, const std::string& title,
                            const known_problem& validated) {
  std::string problem;
  detail::write_file(path, [&](std::ostream& out) {
    problem = write_plan_html(out, buffers, offsets, arena_bytes, lower_bound, title, validated);
  });
  return problem;
}

}  // namespace tensormem::trace
