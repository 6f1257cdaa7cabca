// A server program started by a test: `anchor-sd serve --port 0 ...` as a child process on loopback, its stderr in a
// log file, the port read from its startup line; stopped (SIGTERM, then SIGKILL) when the object goes.
#pragma once

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace anchor::test {

inline std::string read_all(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream os;
    os << in.rdbuf();
    return os.str();
}

class ServeProcess {
public:
    ServeProcess(const std::string& program, std::vector<std::string> args, const std::string& log_name) {
        // CTest runs test cases in parallel processes: each has logs of its own.
        log_ = std::string(ANCHOR_BINARY_DIR) + "/tests/serve/" + log_name + "_" + std::to_string(getpid()) + ".log";
        std::vector<std::string> argv = {program};
        argv.insert(argv.end(), args.begin(), args.end());
        std::ofstream(log_, std::ios::trunc).flush(); // not an earlier run's startup line
        pid_ = fork();
        if (pid_ < 0) throw std::runtime_error("fork failed");
        if (pid_ == 0) {
            if (chdir(ANCHOR_SOURCE_DIR) != 0) _exit(126);
            FILE* f = std::fopen(log_.c_str(), "w");
            if (!f) _exit(126);
            dup2(fileno(f), 2);
            dup2(fileno(f), 1);
            setenv("OMP_NUM_THREADS", "1", 1);
            std::vector<char*> cargv;
            for (auto& a : argv) cargv.push_back(a.data());
            cargv.push_back(nullptr);
            execv(cargv[0], cargv.data());
            _exit(127);
        }
        const std::regex listening("listening on http://[^:]+:([0-9]+)");
        const auto t0 = std::chrono::steady_clock::now();
        while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(120)) {
            std::smatch m;
            const std::string log = read_all(log_);
            if (std::regex_search(log, m, listening)) {
                port_ = std::stoi(m[1]);
                return;
            }
            int status = 0;
            if (waitpid(pid_, &status, WNOHANG) == pid_) {
                pid_ = -1;
                throw std::runtime_error("the server exited before listening:\n" + log);
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        throw std::runtime_error("the server did not listen within 120 s:\n" + read_all(log_));
    }
    ~ServeProcess() {
        if (pid_ <= 0) return;
        kill(pid_, SIGTERM);
        if (wait_exit(20) == -2) {
            kill(pid_, SIGKILL);
            waitpid(pid_, nullptr, 0);
        }
    }
    ServeProcess(const ServeProcess&) = delete;
    ServeProcess& operator=(const ServeProcess&) = delete;

    int port() const { return port_; }
    pid_t pid() const { return pid_; }
    std::string log() const { return read_all(log_); }
    // Whether the log has `text` within `seconds` (the request log line is written after the reply is sent).
    bool log_has(const std::string& text, int seconds = 5) const {
        const auto t0 = std::chrono::steady_clock::now();
        while (log().find(text) == std::string::npos) {
            if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(seconds)) return false;
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        return true;
    }
    httplib::Client client() const {
        httplib::Client c("127.0.0.1", port_);
        c.set_read_timeout(300, 0);
        return c;
    }
    // Exit status after at most `seconds` (-1: killed by a signal, -2: still running).
    int wait_exit(int seconds) {
        const auto t0 = std::chrono::steady_clock::now();
        while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(seconds)) {
            int status = 0;
            if (waitpid(pid_, &status, WNOHANG) == pid_) {
                pid_ = -1;
                return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        return -2;
    }

private:
    pid_t pid_ = -1;
    int port_ = -1;
    std::string log_;
};

inline nlohmann::json post_json(httplib::Client& c, const std::string& path, const nlohmann::json& body, int* status) {
    auto r = c.Post(path.c_str(), body.dump(), "application/json");
    if (!r) throw std::runtime_error("POST " + path + ": no reply (" + httplib::to_string(r.error()) + ")");
    *status = r->status;
    return nlohmann::json::parse(r->body);
}

} // namespace anchor::test
