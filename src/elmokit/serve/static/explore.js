// The page of `elmo serve`: sends the form to POST /explore and draws, per layer, the nearest
// occurrences of the word (a table) and all its occurrences on two principal components (an SVG).
"use strict";

const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
const SIZE = 340, MARGIN = 18;
const $ = (id) => document.getElementById(id);
const SVG_NS = "http://www.w3.org/2000/svg";

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function withMark(text) {  // "a [play] b" -> a <mark>play</mark> b, as text nodes (no HTML injection)
  const span = document.createElement("span");
  const match = text.match(/^(.*?)\[([^\]]*)\](.*)$/);
  if (!match) { span.textContent = text; return span; }
  const mark = document.createElement("mark");
  mark.textContent = match[2];
  span.append(match[1], mark, match[3]);
  return span;
}

function table(layer) {
  const t = document.createElement("table");
  t.className = "neighbours";
  layer.neighbours.forEach((n, i) => {
    const row = t.insertRow();
    row.insertCell().textContent = String(i + 1);
    const cos = row.insertCell(); cos.className = "cos"; cos.textContent = n.cosine.toFixed(4);
    row.insertCell().append(withMark(n.text));
  });
  return t;
}

function picture(layer) {
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("width", SIZE); svg.setAttribute("height", SIZE);
  svg.setAttribute("class", "pca");
  const all = layer.points.concat([layer.query_point]);
  const xs = all.map((p) => p.x), ys = all.map((p) => p.y);
  // each axis scaled to the box; an axis along which every point is the same sits in the middle
  const scale = (v) => {
    const low = Math.min(...v), span = Math.max(...v) - low;
    return span > 1e-9 ? (value) => (value - low) / span : () => 0.5;
  };
  const fx = scale(xs), fy = scale(ys);
  const sx = (x) => MARGIN + fx(x) * (SIZE - 2 * MARGIN);
  const sy = (y) => SIZE - MARGIN - fy(y) * (SIZE - 2 * MARGIN);
  for (const p of layer.points) {
    const c = document.createElementNS(SVG_NS, "circle");
    c.setAttribute("cx", sx(p.x)); c.setAttribute("cy", sy(p.y)); c.setAttribute("r", 6);
    c.setAttribute("fill", COLOURS[p.cluster % COLOURS.length]); c.setAttribute("fill-opacity", "0.75");
    const title = document.createElementNS(SVG_NS, "title");
    title.textContent = p.text;
    c.append(title);
    svg.append(c);
  }
  const q = document.createElementNS(SVG_NS, "text");
  q.setAttribute("x", sx(layer.query_point.x)); q.setAttribute("y", sy(layer.query_point.y));
  q.setAttribute("text-anchor", "middle"); q.setAttribute("dominant-baseline", "central");
  q.setAttribute("font-size", "22"); q.setAttribute("class", "query-star");
  q.textContent = "\u2605";
  svg.append(q);
  return svg;
}

function show(result) {
  const results = $("results");
  results.replaceChildren();
  for (const layer of result.layers) {
    const box = document.createElement("section");
    box.className = "layer";
    const h = document.createElement("h2");
    h.textContent = `layer ${layer.layer} (${layer.name}): ${result.n_occurrences} occurrences`;
    box.append(h, table(layer), picture(layer));
    results.append(box);
  }
  $("status").className = "";
  $("status").textContent = `query: ${result.query}`;
}

// While a request is out: the last results are gone (they answered another question), the
// button is off, and a bar and a clock say the server is working.
function waiting(n) {
  $("results").replaceChildren();
  $("go").disabled = true;
  $("progress").hidden = false;
  $("status").className = "busy";
  const started = performance.now();
  const tick = () => {
    const seconds = Math.floor((performance.now() - started) / 1000);
    $("status").textContent = `embedding ${n} sentence${n === 1 ? "" : "s"}... ${seconds} s`;
  };
  tick();
  const clock = setInterval(tick, 250);
  return () => { clearInterval(clock); $("go").disabled = false; $("progress").hidden = true; };
}

async function explore(event) {
  if (event) event.preventDefault();
  const body = {
    query: $("query").value, word: $("word").value.trim(),
    sentences: $("sentences").value.split("\n").map((s) => s.trim()).filter((s) => s),
  };
  const done = waiting(body.sentences.length);
  try {
    const response = await fetch("/explore", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    const answer = await response.json().catch(() => ({}));
    if (!response.ok) throw new Error(answer.error ? answer.error.message : `${response.status} ${response.statusText}`);
    done();
    show(answer);
  } catch (error) {
    done();
    $("results").replaceChildren();
    $("status").className = "error";
    $("status").textContent = "error: " + error.message;
  }
}

async function start() {
  $("form").addEventListener("submit", explore);
  try {
    const response = await fetch("/explore/examples", { headers: headers() });
    if (response.ok) {
      const examples = await response.json();
      $("query").value = examples.query; $("word").value = examples.word;
      $("sentences").value = examples.sentences.join("\n");
    }
  } catch (error) { /* the page still works with typed text */ }
}

start();
