// Hand-drawn figures: byte counts for people, and small line charts in inline SVG.

export function fmtBytes(n) {
  if (n === undefined || n === null) return "–";
  const u = ["B", "KB", "MB", "GB"];
  let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return `${i ? n.toFixed(1) : n} ${u[i]}`;
}

const SVG = "http://www.w3.org/2000/svg";

function svgEl(name, attrs, text) {
  const e = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

// A line chart in a 300x120 box: series of [x, y] points, each drawn against the shared maxima.
export function plot(svg, series, xMax, yMax, yLabel) {
  const W = 300, H = 120, L = 6, B = 14;
  const px = (x) => L + (W - L - 4) * (xMax ? x / xMax : 0);
  const py = (y) => H - B - (H - B - 16) * (yMax ? y / yMax : 0);  // the top 16 hold the label
  const kids = [svgEl("line", {x1: L, y1: H - B, x2: W, y2: H - B, class: "axis"}),
                svgEl("line", {x1: L, y1: 16, x2: L, y2: H - B, class: "axis"}),
                svgEl("line", {x1: L, y1: 16, x2: W, y2: 16, class: "grid"}),
                svgEl("text", {x: L + 3, y: 11, class: "tick"}, yLabel),
                svgEl("text", {x: W - 2, y: H - 2, class: "tick", "text-anchor": "end"}, String(xMax))];
  for (const {points, cls} of series) {
    kids.push(svgEl("polyline", {points: points.map(([x, y]) => `${px(x).toFixed(1)},${py(y).toFixed(1)}`).join(" "),
                                 class: cls}));
  }
  svg.replaceChildren(...kids);
  svg.dataset.points = String(series.length ? series[0].points.length : 0);
}
