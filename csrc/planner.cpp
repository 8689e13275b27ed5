// dhelix._planner_core: the C++ core of the DP planner (DESIGN §1.3) and of the one-step
// lane simulation (DESIGN §1.5).
//
// It mirrors dhelix/planner/simulate.py (LaneModel.step) and dhelix/planner/dp.py (_dp,
// _PyProblem) operation by operation -- same floating-point operations in the same order,
// same candidate order, strict '<' for replacement -- so both return bit-identical costs
// and the same plan.  Floating-point contraction (FMA) is switched off for that reason.
//
// Python API:
//   Problem(f_lane, b_lane, f_T, b_T, f_saved, b_saved, f_temp, b_temp,
//           stretch_flat[n*m], base_bytes, f_reader, b_reader, f_host=[], b_host=[])
//     .step(i1, i2, j1, j2)            -> (time, peak_bytes)      (memoized)
//     .step_indices(fidx, bidx, mem0)  -> (time, peak_bytes, bytes_at_end)
//     .level(i, j)                     -> bytes alive at state (i, j)
//     .solve(budget=inf)               -> (total, [(i1, i2, j1, j2), ...])  ((inf, []) if none)
//     .solve_carry()                   -> (makespan, steps): the DP over carried states
//                                         (dp.py:_carry_dp; steps back to back)
//   solve_dense(n, m, costs_flat)      -> (total, steps); costs[((i1*(n+1)+i2)*(m+1)+j1)*(m+1)+j2],
//                                          inf where the transition is forbidden
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

const double INF = std::numeric_limits<double>::infinity();
using StepIdx = std::array<int, 4>;

// The DP's state space: n forward ops, m backward ops. Every segment pair is a legal step
// (a step may hold several comm ops of one group: the executor issues them in one
// deterministic order on every rank).
struct Legality {
  int n = 0, m = 0;
};

// The steps from (0, 0) to (n, m), following each state's predecessor in `arg` (an
// (n+1) x (m+1) grid, row-major).
std::vector<StepIdx> backtrack(const std::vector<std::pair<int, int>>& arg, int n, int m) {
  std::vector<StepIdx> steps;
  int i2 = n, j2 = m;
  while (i2 || j2) {
    auto [i1, j1] = arg[static_cast<size_t>(i2) * (m + 1) + j2];
    steps.push_back({i1, i2, j1, j2});
    i2 = i1;
    j2 = j1;
  }
  return std::vector<StepIdx>(steps.rbegin(), steps.rend());
}

// The DP of dp.py:_dp.  `cost(i1, i2, j1, j2)` returns inf for a forbidden transition.
template <class Cost>
std::pair<double, std::vector<StepIdx>> run_dp(const Legality& L, Cost&& cost) {
  const int n = L.n, m = L.m;
  std::vector<double> T(static_cast<size_t>(n + 1) * (m + 1), INF);
  std::vector<std::pair<int, int>> arg(static_cast<size_t>(n + 1) * (m + 1), {-1, -1});
  auto at = [m](int i, int j) { return static_cast<size_t>(i) * (m + 1) + j; };
  T[0] = 0.0;
  for (int i2 = 0; i2 <= n; ++i2) {
    for (int j2 = 0; j2 <= m; ++j2) {
      if (i2 == 0 && j2 == 0) continue;
      double best = INF;
      int bi = -1, bj = -1;
      for (int i1 = 0; i1 <= i2; ++i1) {
        for (int j1 = 0; j1 <= j2; ++j1) {
          if (i1 == i2 && j1 == j2) continue;
          const double prev = T[at(i1, j1)];
          if (prev == INF) continue;
          const double v = prev + cost(i1, i2, j1, j2);
          if (v < best) {
            best = v;
            bi = i1;
            bj = j1;
          }
        }
      }
      T[at(i2, j2)] = best;
      arg[at(i2, j2)] = {bi, bj};
    }
  }
  if (T[at(n, m)] == INF) return {INF, {}};
  return {T[at(n, m)], backtrack(arg, n, m)};
}

py::tuple result(const std::pair<double, std::vector<StepIdx>>& r) {
  py::list steps;
  for (const auto& s : r.second) steps.append(py::make_tuple(s[0], s[1], s[2], s[3]));
  return py::make_tuple(r.first, steps);
}

class Problem {
 public:
  Problem(std::vector<int> f_lane, std::vector<int> b_lane, std::vector<double> f_T, std::vector<double> b_T,
          std::vector<double> f_saved, std::vector<double> b_saved, std::vector<double> f_temp,
          std::vector<double> b_temp, std::vector<double> S, double base,
          std::vector<int> f_reader, std::vector<int> b_reader, std::vector<double> f_H,
          std::vector<double> b_H)
      : f_lane_(std::move(f_lane)), b_lane_(std::move(b_lane)),
        f_reader_(std::move(f_reader)), b_reader_(std::move(b_reader)), f_T_(std::move(f_T)),
        b_T_(std::move(b_T)), f_saved_(std::move(f_saved)), b_saved_(std::move(b_saved)),
        f_temp_(std::move(f_temp)), b_temp_(std::move(b_temp)), S_(std::move(S)),
        f_H_(std::move(f_H)), b_H_(std::move(b_H)), base_(base) {
    n_ = static_cast<int>(f_lane_.size());
    m_ = static_cast<int>(b_lane_.size());
    if (f_H_.empty()) f_H_.assign(n_, 0.0);   // no host times given: comm ops cost none
    if (b_H_.empty()) b_H_.assign(m_, 0.0);
    auto need = [](size_t got, size_t want, const char* what) {
      if (got != want)
        throw std::invalid_argument(std::string("Problem: ") + what + " has the wrong length");
    };
    need(f_T_.size(), n_, "f_T");
    need(b_T_.size(), m_, "b_T");
    need(f_saved_.size(), n_, "f_saved");
    need(b_saved_.size(), m_, "b_saved");
    need(f_temp_.size(), n_, "f_temp");
    need(b_temp_.size(), m_, "b_temp");
    need(S_.size(), static_cast<size_t>(n_) * m_, "stretch");
    need(f_reader_.size(), n_, "f_reader");
    need(b_reader_.size(), m_, "b_reader");
    need(f_H_.size(), n_, "f_host");
    need(b_H_.size(), m_, "b_host");
    for (int v : f_lane_)
      if (v < 0 || v > 2) throw std::invalid_argument("Problem: f_lane must be 0, 1 or 2");
    for (int v : b_lane_)
      if (v < 0 || v > 2) throw std::invalid_argument("Problem: b_lane must be 0, 1 or 2");
    L_ = Legality{n_, m_};
    f_pre_.assign(n_ + 1, 0.0);
    for (int k = 0; k < n_; ++k) f_pre_[k + 1] = f_pre_[k] + f_saved_[k];
    b_pre_.assign(m_ + 1, 0.0);
    for (int k = 0; k < m_; ++k) b_pre_[k + 1] = b_pre_[k] + b_saved_[k];
    const size_t sz = static_cast<size_t>(n_ + 1) * (n_ + 1) * (m_ + 1) * (m_ + 1);
    memo_t_.assign(sz, 0.0);
    memo_p_.assign(sz, 0.0);
    memo_ok_.assign(sz, 0);
  }

  double level(int i, int j) const { return (base_ + f_pre_[i]) - b_pre_[j]; }

  struct Comm { int x, k; double s, e; };
  // What a step hands the next when steps run back to back (simulate.py: Carry).
  struct Carry {
    double t = 0.0;
    double lane_free[3] = {0.0, 0.0, 0.0};
    std::vector<Comm> comms;
    double end = 0.0;
  };

  // One step: LaneModel.step of simulate.py (the executor's replay).  Returns (time,
  // peak, mem at end).  Same operations in the same order as the Python, so both give
  // bit-identical results.  With `carry` the step starts from and updates it.
  std::tuple<double, double, double> simulate(const int* fidx, int na, const int* bidx, int nb,
                                              double mem0, Carry* carry = nullptr) const {
    struct Q { int x; const int* lst; int len; };
    Q qs[2];
    int nq = 0;
    if (na > 0) qs[nq++] = {0, fidx, na};
    if (nb > 0) qs[nq++] = {1, bidx, nb};
    auto lane = [&](int x, int k) { return x == 0 ? f_lane_[k] : b_lane_[k]; };
    auto first_comm = [&](const Q& q) {
      for (int i = 0; i < q.len; ++i)
        if (lane(q.x, q.lst[i]) != 0) return i;
      return q.len;
    };
    if (nq == 2 && first_comm(qs[1]) < first_comm(qs[0])) std::swap(qs[0], qs[1]);
    int pos[2] = {0, 0};
    int cur = 0;
    double t = 0.0;
    double own_lane_free[3] = {0.0, 0.0, 0.0};
    std::vector<Comm> own_comms;
    double* lane_free = own_lane_free;
    std::vector<Comm>& comms = carry ? carry->comms : own_comms;
    if (carry) {
      t = carry->t;
      lane_free = carry->lane_free;
    }
    const double start = t;
    struct MEv { double time; int kind; int seq; double bytes; };
    std::vector<MEv> mevs;
    double span = start;
    while (true) {
      if (pos[0] >= qs[0].len && (nq < 2 || pos[1] >= qs[1].len)) break;
      if (pos[cur] >= qs[cur].len) { cur = 1 - cur; continue; }
      const int x = qs[cur].x;
      const int k = qs[cur].lst[pos[cur]];
      ++pos[cur];
      const std::vector<int>& rd = x == 0 ? f_reader_ : b_reader_;
      double ready = t;
      for (const Comm& c : comms)
        if (c.x == x && rd[c.k] == k && c.e > ready) ready = c.e;
      double alloc, free_;
      if (x == 0) {
        alloc = f_temp_[k] + f_saved_[k];
        free_ = f_temp_[k];
      } else {
        alloc = b_temp_[k];
        free_ = b_temp_[k] + b_saved_[k];
      }
      double st, end;
      const int ln = lane(x, k);
      if (ln == 0) {
        st = ready;
        const double w = x == 0 ? f_T_[k] : b_T_[k];
        end = st + w;
        for (const Comm& c : comms) {
          if (c.x != x && c.s <= st && st < c.e) {
            const double s = x == 0 ? S_[static_cast<size_t>(k) * m_ + c.k]
                                    : S_[static_cast<size_t>(c.k) * m_ + k];
            if (s > 1.0) {
              if (st + w * s <= c.e) end = st + w * s;
              else end = c.e + (w - (c.e - st) / s);
            }
            break;
          }
        }
        t = end;
      } else {
        st = ready > lane_free[ln] ? ready : lane_free[ln];
        end = st + (x == 0 ? f_T_[k] : b_T_[k]);
        lane_free[ln] = end;
        comms.push_back({x, k, st, end});
        t = ready + (x == 0 ? f_H_[k] : b_H_[k]);
        if (nq == 2) cur = 1 - cur;
      }
      const int seq_a = static_cast<int>(mevs.size());
      mevs.push_back({ready, 1, seq_a, alloc});
      mevs.push_back({end, 0, seq_a + 1, free_});
      if (end > span) span = end;
    }
    if (t > span) span = t;
    std::sort(mevs.begin(), mevs.end(), [](const MEv& a, const MEv& b) {
      if (a.time != b.time) return a.time < b.time;
      if (a.kind != b.kind) return a.kind < b.kind;
      return a.seq < b.seq;
    });
    double mem = mem0, peak = mem0;
    for (const MEv& e : mevs) {
      if (e.kind == 1) {
        mem = mem + e.bytes;
        if (mem > peak) peak = mem;
      } else {
        mem = mem - e.bytes;
      }
    }
    if (carry) {
      carry->t = t;
      if (span > carry->end) carry->end = span;
      return {span - start, peak, mem};
    }
    return {span, peak, mem};
  }

  std::pair<double, double> step(int i1, int i2, int j1, int j2) {
    check(i1, i2, j1, j2);
    const size_t key = ((static_cast<size_t>(i1) * (n_ + 1) + i2) * (m_ + 1) + j1) * (m_ + 1) + j2;
    if (!memo_ok_[key]) {
      int fi[64], bi[64];
      std::vector<int> fv, bv;
      int* fp = fi;
      int* bp = bi;
      if (i2 - i1 > 64) { fv.resize(i2 - i1); fp = fv.data(); }
      if (j2 - j1 > 64) { bv.resize(j2 - j1); bp = bv.data(); }
      for (int k = i1; k < i2; ++k) fp[k - i1] = k;
      for (int k = j1; k < j2; ++k) bp[k - j1] = k;
      auto r = simulate(fp, i2 - i1, bp, j2 - j1, level(i1, j1));
      memo_t_[key] = std::get<0>(r);
      memo_p_[key] = std::get<1>(r);
      memo_ok_[key] = 1;
    }
    return {memo_t_[key], memo_p_[key]};
  }

  py::tuple step_indices(const std::vector<int>& fidx, const std::vector<int>& bidx,
                         double mem0) const {
    for (int k : fidx)
      if (k < 0 || k >= n_) throw std::out_of_range("step_indices: forward index out of range");
    for (int k : bidx)
      if (k < 0 || k >= m_) throw std::out_of_range("step_indices: backward index out of range");
    auto r = simulate(fidx.data(), static_cast<int>(fidx.size()), bidx.data(),
                      static_cast<int>(bidx.size()), mem0);
    return py::make_tuple(std::get<0>(r), std::get<1>(r), std::get<2>(r));
  }

  py::tuple solve(double budget) {
    auto r = run_dp(L_, [&](int i1, int i2, int j1, int j2) {
      auto tp = step(i1, i2, j1, j2);
      return tp.second <= budget ? tp.first : INF;
    });
    return result(r);
  }

  // The DP over carried states (dp.py:_carry_dp): state (i, j) keeps the carry of the
  // best way found to reach it (earliest end, then earliest thread time; strict '<'),
  // each transition one step simulated from that carry.  A heuristic: the carry is not a
  // function of (i, j) alone, so unlike `solve` it is not exact.
  py::tuple solve_carry() const {
    const int n = n_, m = m_;
    auto at = [m](int i, int j) { return static_cast<size_t>(i) * (m + 1) + j; };
    std::vector<Carry> C(static_cast<size_t>(n + 1) * (m + 1));
    std::vector<char> has(C.size(), 0);
    std::vector<std::pair<int, int>> arg(C.size(), {-1, -1});
    has[0] = 1;
    std::vector<int> fi(n > 0 ? n : 1), bi(m > 0 ? m : 1);
    for (int i2 = 0; i2 <= n; ++i2) {
      for (int j2 = 0; j2 <= m; ++j2) {
        if (i2 == 0 && j2 == 0) continue;
        bool found = false;
        Carry best;
        int bi1 = -1, bj1 = -1;
        for (int i1 = 0; i1 <= i2; ++i1) {
          for (int j1 = 0; j1 <= j2; ++j1) {
            if (i1 == i2 && j1 == j2) continue;
            if (!has[at(i1, j1)]) continue;
            Carry c = C[at(i1, j1)];
            for (int k = i1; k < i2; ++k) fi[k - i1] = k;
            for (int k = j1; k < j2; ++k) bi[k - j1] = k;
            simulate(fi.data(), i2 - i1, bi.data(), j2 - j1, 0.0, &c);
            if (!found || c.end < best.end || (c.end == best.end && c.t < best.t)) {
              best = c;
              bi1 = i1;
              bj1 = j1;
              found = true;
            }
          }
        }
        C[at(i2, j2)] = best;
        has[at(i2, j2)] = found ? 1 : 0;
        arg[at(i2, j2)] = {bi1, bj1};
      }
    }
    return result({C[at(n, m)].end, backtrack(arg, n, m)});
  }

  int n() const { return n_; }
  int m() const { return m_; }

 private:
  void check(int i1, int i2, int j1, int j2) const {
    if (i1 < 0 || i1 > i2 || i2 > n_ || j1 < 0 || j1 > j2 || j2 > m_)
      throw std::out_of_range("step: need 0 <= i1 <= i2 <= n and 0 <= j1 <= j2 <= m");
  }

  int n_ = 0, m_ = 0;
  std::vector<int> f_lane_, b_lane_, f_reader_, b_reader_;
  std::vector<double> f_T_, b_T_, f_saved_, b_saved_, f_temp_, b_temp_, S_, f_H_, b_H_;
  double base_;
  Legality L_;
  std::vector<double> f_pre_, b_pre_;
  std::vector<double> memo_t_, memo_p_;
  std::vector<char> memo_ok_;
};

py::tuple solve_dense(int n, int m, const std::vector<double>& costs) {
  if (n < 0 || m < 0) throw std::invalid_argument("solve_dense: n and m must be >= 0");
  const size_t sz = static_cast<size_t>(n + 1) * (n + 1) * (m + 1) * (m + 1);
  if (costs.size() != sz)
    throw std::invalid_argument("solve_dense: costs must have (n+1)^2 (m+1)^2 entries");
  // Forbidden transitions (over a memory budget) carry inf.
  const Legality L{n, m};
  auto r = run_dp(L, [&](int i1, int i2, int j1, int j2) {
    return costs[((static_cast<size_t>(i1) * (n + 1) + i2) * (m + 1) + j1) * (m + 1) + j2];
  });
  return result(r);
}

}  // namespace

PYBIND11_MODULE(_planner_core, mod) {
  mod.doc() = "DHelix planner core: one-step lane simulation and the op-level DP (see dp.py)";
  py::class_<Problem>(mod, "Problem")
      .def(py::init<std::vector<int>, std::vector<int>, std::vector<double>, std::vector<double>,
                    std::vector<double>, std::vector<double>, std::vector<double>,
                    std::vector<double>, std::vector<double>, double, std::vector<int>,
                    std::vector<int>, std::vector<double>, std::vector<double>>(),
           py::arg("f_lane"), py::arg("b_lane"), py::arg("f_T"), py::arg("b_T"), py::arg("f_saved"),
           py::arg("b_saved"), py::arg("f_temp"), py::arg("b_temp"), py::arg("stretch"),
           py::arg("base_bytes"), py::arg("f_reader"), py::arg("b_reader"),
           py::arg("f_host") = std::vector<double>(), py::arg("b_host") = std::vector<double>())
      .def("step", &Problem::step, py::arg("i1"), py::arg("i2"), py::arg("j1"), py::arg("j2"))
      .def("step_indices", &Problem::step_indices, py::arg("fidx"), py::arg("bidx"),
           py::arg("mem0") = 0.0)
      .def("level", &Problem::level)
      .def("solve", &Problem::solve, py::arg("budget") = INF)
      .def("solve_carry", &Problem::solve_carry)
      .def_property_readonly("n", &Problem::n)
      .def_property_readonly("m", &Problem::m);
  mod.def("solve_dense", &solve_dense, py::arg("n"), py::arg("m"), py::arg("costs"));
}
